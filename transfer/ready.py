"""The producer's readiness: when kvferry may read pages the scheduler just wrote.

Rule: kvferry reads a chunk's pages (the transport, the staging gather, the
storage write-through) only after the ``ready`` object given to
``KVSender.send`` says the work that wrote them is complete. ``ready`` is a
``torch.cuda.Event`` recorded on the stream that wrote the KV (after the
write), or any object with ``query() -> bool`` (complete?) and/or
``synchronize()`` (block until complete). None: the caller already
synchronised (CPU pools, or a scheduler that synchronised its stream).

Nothing waits on the scheduler's thread: the transport worker polls
``query()`` between rounds, staged parts ask decode for staging only once
the event completed (a :class:`ReadyWaiter` polls it), and the storage
worker waits on its own thread, each for at most ``timeout_s`` after
``send()``; past it the chunk fails with
:class:`~bootstrap.errors.KVTimeoutError`.

Pure: imports neither torch nor zmq nor mooncake (an event is duck-typed).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol
from collections.abc import Callable

from bootstrap.errors import KVTimeoutError

log = logging.getLogger("kvferry.ready")

_MAX_SLEEP_S = 1e-3


class ReadyEvent(Protocol):
    def query(self) -> bool:
        """Whether the producing work is complete (never blocks)."""

    def synchronize(self) -> None:
        """Block until the producing work is complete."""


def check_event(event) -> None:
    """Raise TypeError unless ``event`` can say when it is complete."""
    if event is not None and not (callable(getattr(event, "query", None))
                                  or callable(getattr(event, "synchronize", None))):
        raise TypeError(f"ready must be a torch.cuda.Event or have query()/synchronize(), got {type(event).__name__}")


class ReadyGate:
    """One chunk's ``ready`` event and the deadline to wait for it."""

    def __init__(self, event, timeout_s: float, where: str) -> None:
        check_event(event)
        self.event, self.where, self.timeout_s = event, where, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._done = False
        #: when a poll first found the event complete (None: not yet); the end of the producer's work
        #: as kvferry saw it, to within its threads' polling (the exposed transfer time counts from it)
        self.done_at: float | None = None

    def done(self) -> bool:
        """Whether the pages may be read now (never blocks for an event with
        ``query()``); raises KVTimeoutError once the deadline passed."""
        if self._done:
            return True
        query = getattr(self.event, "query", None)
        if query is None:
            self.event.synchronize()  # no way to ask: block (the caller is a worker thread)
            self._done = True
        else:
            self._done = bool(query())
        if self._done:
            self.done_at = time.monotonic()
        if not self._done and time.monotonic() > self.deadline:
            raise KVTimeoutError(f"{self.where}: the ready event of send() did not complete within "
                                 f"{self.timeout_s:g} s")
        return self._done

    def wait(self) -> None:
        """Block (a worker thread only) until ``done()``, at most until the
        deadline; raises KVTimeoutError then."""
        sleep_s = 20e-6
        while not self.done():
            time.sleep(sleep_s)
            sleep_s = min(_MAX_SLEEP_S, sleep_s * 2)


def gate_for(event, timeout_s: float, where: str) -> ReadyGate | None:
    """A gate for ``event`` (None: nothing to wait for)."""
    return None if event is None else ReadyGate(event, timeout_s, where)


class ReadyWaiter:
    """Runs ``on_ready(error)`` once a gate is done (``error`` None) or past
    its deadline (``error`` the KVTimeoutError), on a thread of its own that
    polls the gates it holds (started when one arrives, gone when none is
    left): for work that must not wait on the thread that queued it (the
    staged parts, whose grants arrive on the control thread)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._items: list[tuple[ReadyGate, Callable[[BaseException | None], None]]] = []
        self._running = False

    def when_ready(self, gate: ReadyGate, on_ready: Callable[[BaseException | None], None]) -> None:
        with self._lock:
            self._items.append((gate, on_ready))
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name=self._name, daemon=True).start()

    def _run(self) -> None:
        sleep_s = 20e-6
        while True:
            with self._lock:
                items = list(self._items)
                if not items:
                    self._running = False
                    return
            for item in items:
                gate, on_ready = item
                try:
                    error = None if gate.done() else False
                except KVTimeoutError as exc:
                    error = exc
                if error is False:
                    continue
                with self._lock:
                    self._items.remove(item)
                try:
                    on_ready(error)
                except Exception:
                    log.exception("%s: a ready callback raised", self._name)
                sleep_s = 20e-6
            time.sleep(sleep_s)
            sleep_s = min(_MAX_SLEEP_S, sleep_s * 2)
