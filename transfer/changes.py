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
the scheduler dropped, and the changes of such a room are left out. The ring
itself holds only numbers (a serial per room, and the states), and a map
from serial to room holds one weak reference per room known: the live
rooms, and dropped ones until the log comes round to them (two looks per
new room). So a garbage collection walks about one object per live room,
not one per entry of the ring (65,536 references to dropped rooms cost a
full collection about 1.5 ms on the 2-core VM).

Not thread-safe; the owner locks (the manager's lock).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

#: Entries kept by default: a consumer may fall this many changes behind.
DEFAULT_CAPACITY = 65536


class ChangeLog:
    """A ring of the last ``capacity`` room changes, read by marks."""

    __slots__ = ("_serials", "_states", "_head", "_capacity", "_serial_of", "_refs", "_ids", "_order", "_next")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"ChangeLog capacity must be at least 1, not {capacity}")
        self._capacity = capacity
        self._serials: list[int] = [0] * capacity  # 0: some room, not named
        self._states: list[Any] = [None] * capacity
        self._head = 0  # entries ever recorded: the mark after the newest
        # the rooms known, by serial: the live ones, and dropped ones until
        # _forget_dropped comes to them; one weak reference each
        self._refs: dict[int, weakref.ref] = {}  # serial -> room
        self._ids: dict[int, int] = {}  # serial -> id(room)
        self._serial_of: dict[int, int] = {}  # id(room) -> serial (checked against _refs: ids are reused)
        self._order: deque[int] = deque()  # the serials, the one looked at longest ago first
        self._next = 0

    @property
    def progress(self) -> int:
        """The mark after the newest entry (grows by one per change)."""
        return self._head

    def record(self, room: Any, state: Any) -> int:
        """Append one change (``room`` None: some room, not named); returns
        the new progress mark. O(1)."""
        i = self._head % self._capacity
        self._serials[i], self._states[i] = (0 if room is None else self._serial(room)), state
        self._head += 1
        return self._head

    def _serial(self, room: Any) -> int:
        key = id(room)
        serial = self._serial_of.get(key)
        if serial is not None and self._refs[serial]() is room:
            return serial
        # a room not seen yet (or a dropped room's id, reused)
        self._forget_dropped(2)
        self._next += 1
        serial = self._serial_of[key] = self._next
        self._refs[serial], self._ids[serial] = weakref.ref(room), key
        self._order.append(serial)
        return serial

    def _forget_dropped(self, looks: int) -> None:
        """Look at the ``looks`` rooms looked at longest ago: forget the
        dropped ones, put the others back at the end. Two looks per new room
        keep the rooms known to about twice the live ones (each dropped one
        is forgotten within a round), at O(1) per room: never a long hold."""
        for _ in range(min(looks, len(self._order))):
            serial = self._order.popleft()
            if self._refs[serial]() is not None:
                self._order.append(serial)
                continue
            del self._refs[serial]
            key = self._ids.pop(serial)
            if self._serial_of.get(key) == serial:
                del self._serial_of[key]

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
            serial = self._serials[n % cap]
            if serial == 0:
                return head, None
            ref = self._refs.get(serial)
            room = None if ref is None else ref()
            if room is not None:  # else dropped by its scheduler
                out.append((room, self._states[n % cap]))
        return head, out
