"""The polling worker every engine's transport runs on, and what they share
of :mod:`transfer.transport.base`'s contract: the job queue and the worker
thread with a bounded ``close()``, the loop that admits jobs and sleeps by
the bytes in flight, the ready-gate check, the peer opens that come before
any job to a peer (:mod:`transfer.transport.opener`), and the guard that
runs a completion callback exactly once and survives its exceptions.

A transport gives the worker its :class:`EngineSide` (the writes in flight):
``admit`` takes a queued job, ``step`` submits what may go and checks what
is in flight, ``fail`` fails one job; and its :class:`PeerOpens` (the engine
side itself unless it gives another): ``open`` opens the way to a peer (on
the opener's thread, never under the step lock). ``admit``, ``step`` and the failures
at close run one at a time under the worker's step lock: on the worker
thread, or on any thread that calls :meth:`PollingWorker.pump` (a busy
scheduler's, which then needs no other thread to get the interpreter lock
for its transfers to move). A job reaches ``admit`` only once its peer
(``job.peer``) is open; until then the opener holds it. The loop
blocks on the queue only while the engine side holds nothing; otherwise it
sleeps a quarter of the time the bytes in flight need at
:data:`ASSUMED_BYTES_PER_S`, within [:data:`MIN_SLEEP_S`,
:data:`MAX_SLEEP_S`]: short waits keep small transfers fast, long ones leave
the CPU to the engine. Importing this module imports no engine.

:func:`close_at_exit`: a transport still open when the interpreter exits is
closed by an ``atexit`` hook, while every thread can still run: left to the
interpreter's finalization, a worker thread stopped inside an engine call
aborts the process (NIXL: ``terminate called without an active exception``,
seen in a third of exits on a loaded machine).
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from typing import Protocol

from transfer.errors import ClosedError, KVFerryError, TransferError
from transfer.transport.opener import PeerOpener
from transfer.transport.peers import PeerLink

log = logging.getLogger("kvferry.transport")

ASSUMED_BYTES_PER_S = 2e9
MIN_SLEEP_S, MAX_SLEEP_S = 20e-6, 1e-3
# How long an idle loop waits before it looks again (put() and wake() wake it at once).
_IDLE_WAIT_S = 1.0
_WAKE = object()  # queued by wake(): the loop steps at once, nothing is admitted


def end_job(job, error: TransferError | None) -> None:
    """End ``job`` (any transport's job: it has ``done`` and ``callback``):
    mark it done and call its completion callback, once; an exception the
    callback raises is logged and the worker goes on. The job lets go of the
    callback first: it closes over the room, and a room keeps its jobs'
    handles, so a finished job that held on to it would make a reference
    cycle that only a garbage collection frees (a collection stops every
    thread of the process for as long as it walks the heap)."""
    job.done = True
    callback, job.callback = job.callback, None
    if callback is None:  # ended already
        return
    try:
        callback(error)
    except Exception:
        log.exception("transport: a completion callback raised; the worker goes on")


_OPEN_TRANSPORTS: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(transport) -> None:
    """Close ``transport`` (its ``close()``) at interpreter exit if it is still open then."""
    _OPEN_TRANSPORTS.add(transport)


@atexit.register
def _close_open_transports() -> None:
    for transport in list(_OPEN_TRANSPORTS):
        try:
            transport.close()
        except Exception:  # exiting: one transport's failure must not keep the others open
            log.exception("closing %s at exit failed", type(transport).__name__)


def closed_error(peer: str) -> TransferError:
    return TransferError("transport closed before the transfer finished", peer=peer)


def gate_state(ready, peer: str) -> tuple[bool, TransferError | None]:
    """``(waiting, error)`` of a job's ready gate (a
    :class:`~transfer.ready.ReadyGate`, or None): ``waiting`` while its
    producer's event is not complete; ``error`` when the gate failed (past
    its deadline): the job fails with it. Polled, never blocking."""
    if ready is None:
        return False, None
    try:
        return not ready.done(), None
    except KVFerryError as exc:
        return False, TransferError(str(exc), peer=peer)


class EngineSide(Protocol):
    """A transport's side of the loop, its writes (its methods run one at a
    time, under the worker's step lock)."""

    def admit(self, job) -> None:
        """Take a job that ``submit`` queued (its peer is open)."""

    def step(self, may_submit: bool) -> tuple[int, bool]:
        """One round: submit what may go (nothing while ``may_submit`` is
        False: a peer open holds the engine's lock), check what is in
        flight, run the callbacks of jobs that ended. Returns (bytes in
        flight, whether any job is held: in flight, or waiting for its ready
        gate)."""

    def fail(self, job, error: TransferError | None = None) -> None:
        """Fail a job that never reached the engine, or every job at close
        (its callback gets ``error``, by default a closed-transport
        TransferError), once."""

    def fail_all(self) -> None:
        """Fail every job held, at close."""

    def idle(self) -> None:
        """The loop had nothing to do for :data:`_IDLE_WAIT_S`: tidy up what
        accumulates without jobs (NIXL: the notifications peers' writes leave)."""


class PeerOpens(Protocol):
    """How a transport's engine opens the way to its peers (for the
    worker's :class:`~transfer.transport.opener.PeerOpener`)."""

    def open(self, peer: str, blob: bytes, pause) -> None:
        """Open the way to ``peer`` (``blob``: what its handshake carried;
        empty when the peer sent none, and again with new metadata): on the
        opener thread, blocking as long as the engine does, an engine call
        that holds the engine's own lock inside ``with pause():``. Raises
        TransferError when the peer cannot be reached."""

    def describe_open(self, link: PeerLink) -> str:
        """What the engine is doing for an open past its deadline, in words."""


class PollingWorker:
    """A transport's job queue and ``kvferry-transport`` thread running
    ``engine``'s loop; ``opens`` opens its peers (default: ``engine``)."""

    def __init__(self, engine: EngineSide, *, open_timeout_s: float = 5.0, opens: PeerOpens | None = None) -> None:
        self.engine = engine
        opens = engine if opens is None else opens
        self.closed = threading.Event()
        #: loop rounds so far (what completion tracking costs), and those run by pump()
        self.num_rounds = 0
        self.num_pumped = 0
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._stop = False  # close() asked the loop to end (under _cond)
        self._step_lock = threading.Lock()
        self._held = False  # the engine side holds jobs (in flight or waiting): pump() has work
        self._busy_since: float | None = None  # when the engine round now running began (None: none runs)
        self._last_round_at = time.monotonic()  # when the last engine round ended
        #: the peer opens that come before any job to a peer
        self.opener = PeerOpener(opens.open, timeout_s=open_timeout_s, step_lock=self._step_lock,
                                 release=self._release, fail=engine.fail, describe=opens.describe_open)
        self._thread = threading.Thread(target=self._loop, name="kvferry-transport", daemon=True)
        self._thread.start()

    def health(self) -> str:
        """The worker in words, for a failure's message: a thread gone, or
        stuck in one engine round, tells a hung engine call from a write the
        engine holds (racy reads: diagnostics only)."""
        now = time.monotonic()
        if not self._thread.is_alive() and not self.closed.is_set():
            return "the transport's worker thread is gone"
        busy = self._busy_since
        if busy is not None and now - busy > 1.0:
            return f"the transport's worker has been in one engine round for {now - busy:.1f} s"
        return f"the transport's last round ended {now - self._last_round_at:.2f} s ago"

    def check_open(self) -> None:
        """ClosedError once the transport is closed."""
        if self.closed.is_set():
            raise ClosedError("transport is closed")

    def put(self, job) -> None:
        """Queue a job (held by the opener until its peer is open);
        ClosedError once the transport is closed."""
        self.check_open()
        if not self.opener.admits(job):
            return
        with self._cond:
            self.check_open()
            self._queue.append(job)
            self._cond.notify()

    def _release(self, jobs: list) -> None:
        """Jobs whose peer opened: queued (failed, when closed meanwhile)."""
        with self._cond:
            if not self._stop:
                self._queue.extend(jobs)
                self._cond.notify()
                return
        for job in jobs:
            self.engine.fail(job)

    def wake(self) -> None:
        """Make the loop step at once (the engine side has news of its own)."""
        with self._cond:
            self._queue.append(_WAKE)
            self._cond.notify()

    def pump(self) -> None:
        """Admit what is queued and run one step, now, on this thread; at once
        when there is nothing to do or another thread is stepping."""
        if (not self._held and not self._queue) or not self._step_lock.acquire(blocking=False):
            return
        try:
            if not self._stop:
                self._round(self._admit_and_step)
                self.num_pumped += 1
        finally:
            self._step_lock.release()

    def _take(self) -> list:
        with self._cond:
            items = list(self._queue)
            self._queue.clear()
        return items

    def _admit_queued(self) -> None:
        for item in self._take():
            if item is not _WAKE:
                self.engine.admit(item)
                self._held = True

    def _round(self, run):
        """``run()`` under the step lock (the caller holds it), timed for :meth:`health`."""
        self._busy_since = time.monotonic()
        try:
            return run()
        finally:
            self._busy_since = None
            self._last_round_at = time.monotonic()

    def _admit_and_step(self) -> int:
        self._admit_queued()
        inflight, self._held = self.engine.step(not self.opener.paused)
        self.num_rounds += 1
        return inflight

    def _loop(self) -> None:
        while True:
            with self._cond:
                idle = False
                while not self._stop and not self._queue and not self._held:
                    if not self._cond.wait(_IDLE_WAIT_S):
                        idle = True
                        break
                if self._stop:
                    break
            if idle:
                with self._step_lock:
                    self._round(self.engine.idle)
                continue
            with self._step_lock:
                inflight = self._round(self._admit_and_step)
                held = self._held
            if inflight:
                time.sleep(min(MAX_SLEEP_S, max(MIN_SLEEP_S, inflight / ASSUMED_BYTES_PER_S / 4)))
            elif held:  # only jobs whose ready event is not complete
                time.sleep(MIN_SLEEP_S)
        with self._step_lock:
            self.engine.fail_all()

    def close(self, timeout_s: float) -> bool:
        """Stop the loop (waiting at most ``timeout_s``) and fail the jobs
        still queued. False when it was closed already."""
        with self._cond:
            if self.closed.is_set():
                return False
            self.closed.set()
            self._stop = True
            self._cond.notify()
        self.opener.close()
        self._thread.join(timeout_s)  # a step that runs past the bound: its jobs fail when it ends
        for job in self._take():
            if job is not _WAKE:
                self.engine.fail(job)
        return True
