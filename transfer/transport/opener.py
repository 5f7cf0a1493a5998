"""Opening the way to peers before any plan goes there, off every scheduler
thread (the rule and the states: :mod:`transfer.transport.peers`).

:class:`PeerOpener` runs a transport's engine opens (``open_call(peer,
blob, pause)``: Mooncake opens the peer's segment and sends a probe write;
NIXL loads the peer agent's metadata) one at a time on its
``kvferry-open-call`` thread, and keeps their deadlines, waiters and the
plans that wait for them on its ``kvferry-opener`` thread. An engine call
can block for seconds (Mooncake's P2P handshake waits behind whatever holds
the peer's listener) and cannot be interrupted: its attempt fails at its
deadline all the same, the plans waiting for it fail with a
:class:`~transfer.errors.HandshakeError`, and the call's late result is
dropped. Both threads sleep in waits, the interpreter lock released, while
there is nothing to open.

``pause()``: the engine call that may block holds the engine's own lock
(Mooncake's binding takes one engine-wide mutex around every write
submission and the segment open inside it), so while it runs the worker's
steps submit nothing (``paused``) and only check what is in flight: a
scheduler's ``pump()`` never queues behind a handshake.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable

from transfer.errors import HandshakeError, TransferError
from transfer.transport.peers import OpenCallback, PeerLink, PeerState, PeerTable, Started

log = logging.getLogger("kvferry.transport")

#: An open that has run this long is logged as a warning (once per attempt).
SLOW_OPEN_S = 1.0
# How often the opener looks at its deadlines while something is opening.
_TICK_S = 0.05

#: ``open_call(peer, blob, pause)``: open the way to ``peer`` (blocking; raises TransferError).
OpenCall = Callable[[str, bytes, Callable[[], contextlib.AbstractContextManager]], None]


class PeerOpener:
    """A transport's peer opens (see the module docstring).

    ``release(jobs)`` hands plans whose peer opened back to the worker's
    queue; ``fail(job, error)`` fails a plan whose peer could not be opened
    (on the opener thread: the plan never reached the engine).
    ``describe(link)`` says what the engine is doing for a late attempt.
    ``step_lock`` is the worker's: ``paused`` changes under it."""

    def __init__(self, open_call: OpenCall, *, timeout_s: float, step_lock: threading.Lock,
                 release: Callable[[list], None], fail: Callable[[object, TransferError], None],
                 describe: Callable[[PeerLink], str] = lambda link: "") -> None:
        self._open_call, self._release, self._fail, self._describe = open_call, release, fail, describe
        self._step_lock = step_lock
        self.table = PeerTable(timeout_s)
        #: engine calls under pause() now: while > 0 the worker's steps submit nothing (read under the step lock)
        self.paused = 0
        self._lock = threading.Condition()
        self._parked: dict[str, list] = collections.defaultdict(list)
        self._calls: collections.deque[Started] = collections.deque()
        self._call_started: tuple[Started, float] | None = None  # the engine call running now
        self._closed = False
        self._results: list[tuple[Started, TransferError | None, float]] = []
        self._threads = [threading.Thread(target=self._manage, name="kvferry-opener", daemon=True),
                         threading.Thread(target=self._run_calls, name="kvferry-open-call", daemon=True)]
        for t in self._threads:
            t.start()

    # --- any thread -----------------------------------------------------------------

    def open(self, peer: str, blob: bytes, callback: OpenCallback | None = None) -> None:
        """Open the way to ``peer`` (``blob``: the metadata its handshake
        carried); returns at once. ``callback(None)`` once it is open,
        ``callback(HandshakeError)`` when it could not be (on the opener
        thread; at once, here, when it is open already with this blob)."""
        now_open = False
        with self._lock:
            if self._closed:
                error = HandshakeError(f"transport closed before the way to {peer} was opened", peer=peer)
            else:
                error = None
                started = self.table.ask(peer, blob, time.monotonic(), callback)
                if started is not None:
                    self._start(started)
                now_open = started is None and self.table.state(peer) is PeerState.OPEN
        if callback is not None and (error is not None or now_open):
            callback(error)

    def admits(self, job) -> bool:
        """Whether ``job`` (a plan for ``job.peer``) may go to the engine now;
        otherwise it is parked until its peer opened (an open is asked for
        a peer never opened, or whose open failed: again with its last
        metadata) and released or failed then."""
        with self._lock:
            if self.table.state(job.peer) is PeerState.OPEN:
                return True
            self._parked[job.peer].append(job)
            link = self.table.links.get(job.peer)
            started = self.table.ask(job.peer, link.blob if link is not None else b"", time.monotonic())
            if started is not None:
                self._start(started)
            return False

    @contextlib.contextmanager
    def pause(self):
        """Around an engine call that holds the engine's lock: the worker's
        steps submit nothing meanwhile (they still check what is in flight)."""
        with self._step_lock:
            self.paused += 1
        try:
            yield
        finally:
            with self._step_lock:
                self.paused -= 1

    def state(self, peer: str) -> PeerState | None:
        with self._lock:
            return self.table.state(peer)

    def link(self, peer: str) -> PeerLink | None:
        with self._lock:
            return self.table.links.get(peer)

    def describe_peer(self, peer: str) -> str:
        """The peer's open in words, for a plan's status (racy: diagnostics only)."""
        link = self.table.links.get(peer)
        if link is None or link.state is PeerState.OPEN:
            return ""
        if link.state is PeerState.FAILED:
            return f"the way to {peer} could not be opened: {link.error}"
        return (f"waiting for the way to {peer} to open (handshake running for "
                f"{time.monotonic() - link.started_at:.1f} s of at most {self.table.timeout_s:g} s)")

    def counters(self) -> dict[str, float]:
        """``handshakes``, ``handshake_failures``, ``handshake_timeouts``,
        ``handshake_seconds`` (summed over finished ones), ``handshakes_in_progress``."""
        with self._lock:
            t = self.table
            return {"handshakes": t.num_opened, "handshake_failures": t.num_failed,
                    "handshake_timeouts": t.num_timed_out, "handshake_seconds": t.open_seconds,
                    "handshakes_in_progress": t.num_opening}

    def close(self) -> None:
        """Fail what waits (parked plans, waiters) and stop both threads
        (an engine call still running is left to end on its own)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            parked, self._parked = self._parked, collections.defaultdict(list)
            waiters = [w for link in self.table.links.values() for w in self.table.take_waiters(link)]
            self._lock.notify_all()
        error = TransferError("transport closed before the peer's handshake ended")
        for jobs in parked.values():
            for job in jobs:
                self._fail(job, error)
        for w in waiters:
            _call(w, error)
        for t in self._threads:
            t.join(1.0)

    # --- internals ---------------------------------------------------------------------

    def _start(self, started: Started) -> None:
        """Queue an attempt's engine call (under the lock)."""
        self._calls.append(started)
        self._lock.notify_all()

    def _run_calls(self) -> None:
        """``kvferry-open-call``: the engine opens, one at a time, in order."""
        while True:
            with self._lock:
                while not self._calls and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                started = self._calls.popleft()
                link = self.table.links.get(started.peer)
                if link is None or link.attempt != started.attempt or link.state is not PeerState.OPENING:
                    continue  # expired while it waited
                self._call_started = (started, time.monotonic())
            error = None
            try:
                self._open_call(started.peer, started.blob, self.pause)
            except TransferError as exc:
                error = exc if isinstance(exc, HandshakeError) else HandshakeError(
                    f"the handshake with {started.peer} failed: {exc}", peer=started.peer, code=exc.code)
            except Exception as exc:  # an engine's surprise must not end the opener
                log.exception("opening the way to %s", started.peer)
                error = HandshakeError(f"the handshake with {started.peer} failed: {type(exc).__name__}: {exc}",
                                       peer=started.peer)
            with self._lock:
                self._call_started = None
                self._results.append((started, error, time.monotonic()))
                self._lock.notify_all()

    def _manage(self) -> None:
        """``kvferry-opener``: results, deadlines, slow-open warnings, and
        telling waiters and parked plans (outside the lock)."""
        while True:
            with self._lock:
                while not self._results and not self._closed and not self.table.num_opening:
                    self._lock.wait()
                if self._closed:
                    return
                if not self._results:
                    self._lock.wait(_TICK_S)
                now = time.monotonic()
                ended: list[PeerLink] = []
                for started, error, at in self._results:
                    link = self.table.finish(started.peer, started.attempt, error, at)
                    if link is not None:
                        ended.append(link)
                    elif error is None:
                        log.info("the way to %s opened %.1f s after its handshake had been given up",
                                 started.peer, at - self.table.links[started.peer].started_at
                                 if started.peer in self.table.links else 0.0)
                self._results = []
                ended += self.table.expire(now, self._what)
                slow = [(link.peer, now - link.started_at, self._what(link)) for link in self.table.slow(now, SLOW_OPEN_S)]
                tell = []
                for link in ended:
                    jobs = self._parked.pop(link.peer, [])
                    tell.append((link, self.table.take_waiters(link), jobs))
            for peer, took, what in slow:
                log.warning("opening the way to %s: its handshake has taken %.1f s so far (at most %g s)%s",
                            peer, took, self.table.timeout_s, f": {what}" if what else "")
            for link, waiters, jobs in tell:
                if link.error is not None:
                    log.warning("%s", link.error)
                    for job in jobs:
                        self._fail(job, link.error)
                elif jobs:
                    self._release(jobs)
                for w in waiters:
                    _call(w, link.error)

    def _what(self, link: PeerLink) -> str:
        """What the engine is doing for ``link`` (under the lock)."""
        running = self._call_started
        if running is not None and running[0].peer != link.peer:
            return (f"waiting behind the handshake with {running[0].peer}, in the engine for "
                    f"{time.monotonic() - running[1]:.1f} s (one engine call at a time)")
        try:
            return self._describe(link)
        except Exception as exc:  # diagnostics must not break the opener
            return f"({type(exc).__name__} describing it: {exc})"


def _call(callback: OpenCallback, error: TransferError | None) -> None:
    try:
        callback(error)
    except Exception:
        log.exception("a peer-open callback raised; the opener goes on")
