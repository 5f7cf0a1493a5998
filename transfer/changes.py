"""Which rooms changed: a bounded log of room state changes. Pure.

The rule: every change of a room's state appends one entry ``(room, state)``
(``room`` is the room's :class:`~transfer.rooms.sender.KVSender` or
:class:`~transfer.rooms.receiver.KVReceiver`) and advances ``progress`` by one.
A consumer keeps its own mark (a ``progress`` value it has seen) and asks
``since(mark)`` for what changed after it; any number of consumers may read
the one log, each at its own pace, and none of them removes anything.

Memory is bounded: the log keeps the last ``capacity`` entries in a ring. A
consumer whose mark is older than the oldest entry kept has fallen behind:
``since`` then answers ``None`` ("poll every room you hold"), and the
consumer goes on from the new mark. A change recorded without naming its
room (``room`` None) also makes ``since`` answer ``None`` for the ranges
that hold it: the log never claims a room did not change when it may have.

The log holds rooms by weak reference: it never keeps a room alive that
the scheduler dropped, and the changes of such a room are left out.

Not thread-safe; the owner locks (the manager's lock).
"""

from __future__ import annotations

import weakref
from typing import Any

#: Entries kept by default: a consumer may fall this many changes behind.
DEFAULT_CAPACITY = 65536


class ChangeLog:
    """A ring of the last ``capacity`` room changes, read by marks."""

    __slots__ = ("_rooms", "_states", "_head", "_capacity")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"ChangeLog capacity must be at least 1, not {capacity}")
        self._capacity = capacity
        self._rooms: list[Any] = [None] * capacity
        self._states: list[Any] = [None] * capacity
        self._head = 0  # entries ever recorded: the mark after the newest

    @property
    def progress(self) -> int:
        """The mark after the newest entry (grows by one per change)."""
        return self._head

    def record(self, room: Any, state: Any) -> int:
        """Append one change (``room`` None: some room, not named); returns
        the new progress mark. O(1)."""
        i = self._head % self._capacity
        self._rooms[i], self._states[i] = (None if room is None else weakref.ref(room)), state
        self._head += 1
        return self._head

    def since(self, mark: int) -> tuple[int, list[tuple[Any, Any]] | None]:
        """``(progress, changes)``: the changes recorded after ``mark``, oldest
        first, one entry per change (a room may appear more than once); or
        ``(progress, None)`` when the consumer fell behind (or a change did
        not name its room) and must poll every room. O(changes returned).
        A mark from the future (a different log) raises ValueError."""
        head = self._head
        if mark > head or mark < 0:
            raise ValueError(f"progress mark {mark} is outside this log (0..{head})")
        if head - mark > self._capacity:
            return head, None
        cap = self._capacity
        out = []
        for n in range(mark, head):
            ref = self._rooms[n % cap]
            if ref is None:
                return head, None
            room = ref()
            if room is not None:  # else dropped by its scheduler
                out.append((room, self._states[n % cap]))
        return head, out

