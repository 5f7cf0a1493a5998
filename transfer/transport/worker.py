"""What every transport's worker shares (:mod:`transfer.transport.base`'s
contract, kept once): the job queue and the worker thread with a bounded
``close()``, the ready-gate check, and the guard that runs a completion
callback exactly once and survives its exceptions.

A transport builds one :class:`TransportWorker` with the loop it runs
(``run(jobs)``, on the worker thread) and a ``fail`` function that fails one
job left over at close. Importing this module imports no engine.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from transfer.errors import ClosedError, KVFerryError, TransferError
from transfer.transport.base import DoneCallback

log = logging.getLogger("kvferry.transport")


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


class TransportWorker:
    """A transport's job queue and worker thread. ``run(jobs)`` is the loop:
    it takes jobs from ``jobs`` (a SimpleQueue) and returns when it takes
    None (the close marker); jobs it did not take by then are given to
    ``fail`` after it returned (or after ``close``'s bound)."""

    def __init__(self, run: Callable[[queue.SimpleQueue], None], fail: Callable[[object], None]) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = threading.Event()
        self._fail = fail
        self._thread = threading.Thread(target=run, args=(self.jobs,), name="kvferry-transport", daemon=True)
        self._thread.start()

    def check_open(self) -> None:
        """ClosedError once the transport is closed."""
        if self.closed.is_set():
            raise ClosedError("transport is closed")

    def put(self, job) -> None:
        """Queue a job; ClosedError once the transport is closed."""
        self.check_open()
        self.jobs.put(job)

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
                return True
            if job is not None:
                self._fail(job)
