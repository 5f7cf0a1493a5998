"""The kvferry tier's store thread: every call of the tier's store, one at a time.

vLLM calls its secondary tiers on the scheduler's thread, which must never
block; a kvferry store may be called by one thread at a time and each call
returns within the store's own bound. So the tier hands its work here as
tasks (:class:`Lookup`, :class:`Store`, :class:`Load`), and this thread runs
them, loads first (a request waits for them), then lookups, then stores, in
order of submission within each kind, and puts one result per task
(:class:`LookupDone`, :class:`JobDone`) on a queue the scheduler's thread
reads without blocking (:meth:`StoreThread.take_results`).

Failures: a key that is missing or the wrong size is that key's ``False``;
a store that fails as a whole (an exception: unreachable, timed out, closed,
a malformed call) fails the task's remaining keys, with ``error`` saying
why, and the thread goes on with the next task. No exception leaves the
thread. The thread opens nothing: it is handed an open store, and closes it
when it stops (:meth:`StoreThread.stop`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from transfer.storage.base import Segment, StorageBackend

log = logging.getLogger("kvferry.vllm.tier")


@dataclass(frozen=True)
class Lookup:
    """Which of ``keys`` the store has (``batch_id``: the caller's name for the batch)."""

    batch_id: int
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Store:
    """Write each key's chunk (one segment each) unless the store has it already."""

    job_id: int
    keys: tuple[str, ...]
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class Load:
    """Read each key's chunk into its segment."""

    job_id: int
    keys: tuple[str, ...]
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class LookupDone:
    """Per key of the batch, whether the store has it; ``error`` when the
    store failed as a whole (every key then absent)."""

    batch_id: int
    present: tuple[bool, ...]
    error: str | None = None


@dataclass(frozen=True)
class JobDone:
    """A store or load ended: per key whether it is stored (or was there) or
    loaded; ``error`` when the store failed as a whole or the job was
    cancelled before it started; ``seconds`` of store calls."""

    job_id: int
    ok: tuple[bool, ...]
    seconds: float
    error: str | None = None


Task = Lookup | Store | Load
_PRIORITY = {Load: 0, Lookup: 1, Store: 2}


class StoreThread:
    """One daemon thread per tier that owns ``store`` (see the module docstring).

    Threads: :meth:`submit`, :meth:`take_results`, :meth:`wait_idle`,
    :meth:`stop` from the scheduler's thread. Only :meth:`wait_idle` (until
    every queued task ran, each call within the store's bound) and
    :meth:`stop` (at most ``timeout_s``) block.
    """

    def __init__(self, store: StorageBackend, *, batch_keys: int, name: str) -> None:
        self._store, self._batch = store, batch_keys
        self._cond = threading.Condition()
        self._tasks: list[tuple[int, int, Task]] = []  # a heap of (priority, order, task)
        self._order = itertools.count()
        self._running = False
        self._stopping = False
        self._results: queue.SimpleQueue[LookupDone | JobDone] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # --- the scheduler's side ----------------------------------------------------

    def submit(self, task: Task) -> None:
        """Queue ``task``; never blocks. After :meth:`stop` a job is answered
        cancelled at once and a lookup as absent."""
        with self._cond:
            if not self._stopping:
                heapq.heappush(self._tasks, (_PRIORITY[type(task)], next(self._order), task))
                self._cond.notify()
                return
        self._results.put(_cancelled(task, "the tier is shut down"))

    def take_results(self) -> list[LookupDone | JobDone]:
        """Every result put since the last call; never blocks."""
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no task is queued or running (True), or ``timeout_s`` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._tasks and not self._running, timeout_s)

    def stop(self, timeout_s: float) -> bool:
        """Cancel what is queued, let the running call end, close the store
        on the thread; True when the thread ended within ``timeout_s``.
        Idempotent."""
        with self._cond:
            self._stopping = True
            dropped, self._tasks = self._tasks, []
            self._cond.notify()
        for _, _, task in sorted(dropped):
            self._results.put(_cancelled(task, "the tier is shut down"))
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # --- the thread ----------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._tasks or self._stopping)
                    if not self._tasks:  # stopping, nothing left
                        return
                    _, _, task = heapq.heappop(self._tasks)
                    self._running = True
                try:
                    self._results.put(self._run(task))
                finally:
                    with self._cond:
                        self._running = False
                        self._cond.notify_all()
        finally:
            try:
                self._store.close()
            except Exception:  # noqa: BLE001 (a store that fails to close is logged, nothing else can be done)
                log.exception("kvferry tier: closing the store %s failed", self._store.url)

    def _run(self, task: Task) -> LookupDone | JobDone:
        if isinstance(task, Lookup):
            try:
                return LookupDone(task.batch_id, tuple(self._present(task.keys)))
            except Exception as exc:  # noqa: BLE001 (the whole store failed: every key absent, said why)
                log.warning("kvferry tier: lookup of %d chunk(s) at %s failed: %s", len(task.keys), self._store.url, exc)
                return LookupDone(task.batch_id, (False,) * len(task.keys), f"{type(exc).__name__}: {exc}")
        ok = [False] * len(task.keys)
        started = time.monotonic()
        try:
            if isinstance(task, Store):
                self._put(task, ok)
            else:
                self._get(task, ok)
        except Exception as exc:  # noqa: BLE001 (the whole store failed: the remaining keys fail, said why)
            what = "store" if isinstance(task, Store) else "load"
            log.warning("kvferry tier: %s job %d (%d chunks) at %s failed after %d: %s", what, task.job_id,
                        len(task.keys), self._store.url, sum(ok), exc)
            return JobDone(task.job_id, tuple(ok), time.monotonic() - started, f"{type(exc).__name__}: {exc}")
        return JobDone(task.job_id, tuple(ok), time.monotonic() - started)

    def _present(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether the store has it (``exists`` answers runs: one call per run and per gap)."""
        out: list[bool] = []
        while len(out) < len(keys):
            rest = keys[len(out):len(out) + self._batch]
            run = self._store.exists(rest)
            out += [True] * run
            if run < len(rest):
                out.append(False)
        return out

    def _put(self, task: Store, ok: list[bool]) -> None:
        todo = []
        for i, there in enumerate(self._present(task.keys)):
            ok[i] = there
            if not there:
                todo.append(i)
        for start in range(0, len(todo), self._batch):
            batch = todo[start:start + self._batch]
            stored = self._store.put([task.keys[i] for i in batch], [[task.segments[i]] for i in batch])
            for i, done in zip(batch, stored, strict=True):
                ok[i] = done

    def _get(self, task: Load, ok: list[bool]) -> None:
        for start in range(0, len(task.keys), self._batch):
            batch = range(start, min(start + self._batch, len(task.keys)))
            got = self._store.get_into([task.keys[i] for i in batch], [[task.segments[i]] for i in batch])
            for i, done in zip(batch, got, strict=True):
                ok[i] = done


def _cancelled(task: Task, why: str) -> LookupDone | JobDone:
    if isinstance(task, Lookup):
        return LookupDone(task.batch_id, (False,) * len(task.keys), why)
    return JobDone(task.job_id, (False,) * len(task.keys), 0.0, why)
