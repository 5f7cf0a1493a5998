"""The polling worker every engine's transport runs on, and what they share
of :mod:`transfer.transport.base`'s contract: the job queue and the worker
thread with a bounded ``close()``, the loop that admits jobs and sleeps by
the bytes in flight, the ready-gate check, and the guard that runs a
completion callback exactly once and survives its exceptions.

A transport gives the worker its :class:`EngineSide`, whose methods all run
on the worker thread: ``admit`` takes a queued job, ``step`` submits what may
go and checks what is in flight, ``fail`` fails one job at close. The loop
blocks on the queue only while the engine side holds nothing; otherwise it
sleeps a quarter of the time the bytes in flight need at
:data:`ASSUMED_BYTES_PER_S`, within [:data:`MIN_SLEEP_S`,
:data:`MAX_SLEEP_S`]: short waits keep small transfers fast, long ones leave
the CPU to the engine. Importing this module imports no engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Protocol

from transfer.errors import ClosedError, KVFerryError, TransferError
from transfer.transport.base import DoneCallback

log = logging.getLogger("kvferry.transport")

ASSUMED_BYTES_PER_S = 2e9
MIN_SLEEP_S, MAX_SLEEP_S = 20e-6, 1e-3
# How long the loop blocks on an empty queue before it steps again.
_IDLE_WAIT_S = 0.05
_WAKE = object()  # queued by wake(): the loop steps at once, nothing is admitted


def run_callback(callback: DoneCallback, error: TransferError | None) -> None:
    """Call a plan's completion callback; an exception it raises is logged
    and the worker goes on."""
    try:
        callback(error)
    except Exception:
        log.exception("transport: a completion callback raised; the worker goes on")


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
    """A transport's side of the loop (every method on the worker thread)."""

    def admit(self, job) -> None:
        """Take a job that ``submit`` queued."""

    def step(self) -> tuple[int, bool]:
        """One round: submit what may go, check what is in flight, run the
        callbacks of jobs that ended. Returns (bytes in flight, whether any
        job is held: in flight, or waiting for its ready gate)."""

    def fail(self, job) -> None:
        """Fail a job at close (its callback gets a TransferError), once."""

    def fail_all(self) -> None:
        """Fail every job held, at close."""


class PollingWorker:
    """A transport's job queue and ``kvferry-transport`` thread running
    ``engine``'s loop."""

    def __init__(self, engine: EngineSide) -> None:
        self.engine = engine
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = threading.Event()
        #: loop rounds so far (what completion tracking costs)
        self.num_rounds = 0
        self._thread = threading.Thread(target=self._loop, name="kvferry-transport", daemon=True)
        self._thread.start()

    def check_open(self) -> None:
        """ClosedError once the transport is closed."""
        if self.closed.is_set():
            raise ClosedError("transport is closed")

    def put(self, job) -> None:
        """Queue a job; ClosedError once the transport is closed."""
        self.check_open()
        self.jobs.put(job)

    def wake(self) -> None:
        """Make the loop step at once (the engine side has news of its own)."""
        self.jobs.put(_WAKE)

    def _loop(self) -> None:
        engine, jobs, held = self.engine, self.jobs, False
        while True:
            try:
                item = jobs.get_nowait() if held else jobs.get(timeout=_IDLE_WAIT_S)
                while True:
                    if item is None:  # close()
                        engine.fail_all()
                        return
                    if item is not _WAKE:
                        engine.admit(item)
                    item = jobs.get_nowait()
            except queue.Empty:
                pass
            inflight, held = engine.step()
            self.num_rounds += 1
            if inflight:
                time.sleep(min(MAX_SLEEP_S, max(MIN_SLEEP_S, inflight / ASSUMED_BYTES_PER_S / 4)))
            elif held:  # only jobs whose ready event is not complete
                time.sleep(MIN_SLEEP_S)

    def close(self, timeout_s: float) -> bool:
        """Stop the loop (waiting at most ``timeout_s``) and fail the jobs
        still queued. False when it was closed already."""
        if self.closed.is_set():
            return False
        self.closed.set()
        self.jobs.put(None)
        self._thread.join(timeout_s)
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and job is not _WAKE:
                self.engine.fail(job)
        if self._thread.is_alive():  # a step ran past the bound: it stops at its next look at the queue
            self.jobs.put(None)
        return True
