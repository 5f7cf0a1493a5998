"""Non-blocking existence answers for the kvferry tier. Pure.

The rule: vLLM's scheduler asks whether a chunk is in the store and must get
an answer at once. The first question about a key answers "not yet" (None)
and queues the key; once per scheduler step the queued keys go to the
store's thread as one batch (:meth:`LookupTable.take_queued`); the thread's
answer (:meth:`answer`) is kept while a request still asks about the key,
and returned from then on. A key's entry lives while a request refers to
it, and an entry in flight lives until its answer came (then it goes if no
request is left). What the tier learns later corrects a kept answer: a
store of the key (:meth:`learn` True), a failed load (False: otherwise the
scheduler would promote it again and again).

Threads: the scheduler's thread only (the answers come back through the
tier's result queue). Nothing here blocks or raises.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field


class Phase(enum.Enum):
    QUEUED = "queued"  # asked, not yet sent to the store's thread
    IN_FLIGHT = "in flight"  # sent, not yet answered
    ANSWERED = "answered"


@dataclass(slots=True)
class _Entry:
    phase: Phase = Phase.QUEUED
    present: bool | None = None
    requests: set[str] = field(default_factory=set)


class LookupTable:
    """Keys (any hashable) -> the store's answer, per the module's rule."""

    def __init__(self) -> None:
        self._entries: dict[object, _Entry] = {}
        self._by_request: dict[str, set[object]] = {}
        self._queued: list[object] = []

    def ask(self, key, request_id: str) -> bool | None:
        """The answer about ``key``: True, False, or None (not yet; the key
        is queued if it was not asked before)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            self._queued.append(key)
        entry.requests.add(request_id)
        self._by_request.setdefault(request_id, set()).add(key)
        return entry.present

    def take_queued(self) -> list:
        """The keys to send to the store's thread now (each once); they are in flight from here."""
        keys, self._queued = self._queued, []
        for key in keys:
            self._entries[key].phase = Phase.IN_FLIGHT
        return keys

    def answer(self, keys: Iterable, present: Iterable[bool]) -> None:
        """The store's thread answered these keys (the batch :meth:`take_queued` gave)."""
        for key, found in zip(keys, present, strict=True):
            entry = self._entries.get(key)
            if entry is None or entry.phase is not Phase.IN_FLIGHT:
                continue
            if not entry.requests:
                del self._entries[key]
                continue
            entry.phase, entry.present = Phase.ANSWERED, bool(found)

    def learn(self, keys: Iterable, present: bool) -> None:
        """Correct kept answers: ``keys`` are (True) or are not (False) in the
        store now. An entry still queued or in flight keeps its own answer."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.phase is Phase.ANSWERED:
                entry.present = present

    def forget(self, request_id: str) -> None:
        """The request finished: drop its references (entries in flight stay until answered)."""
        for key in self._by_request.pop(request_id, ()):
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.requests.discard(request_id)
            if not entry.requests and entry.phase is Phase.ANSWERED:
                del self._entries[key]
            elif not entry.requests and entry.phase is Phase.QUEUED:
                del self._entries[key]
                self._queued.remove(key)

    @property
    def num_waiting(self) -> int:
        """Keys queued or in flight."""
        return sum(1 for e in self._entries.values() if e.phase is not Phase.ANSWERED)

    def __len__(self) -> int:
        return len(self._entries)
