"""Prefill side: the control messages for rooms whose sender the scheduler
has not created yet. Pure.

A decode rank may be early: its TransferRequest (or RoomAbort) for a room
can arrive before the prefill scheduler creates the room's sender. The
rank's room table (:class:`~transfer.rooms.prefill_table.PrefillRooms`)
keeps such messages here, for at most ``bootstrap_timeout_s`` each, and
hands them to the sender when it is created. A flood must not exhaust
memory: at most ``max_rooms`` rooms are kept (the oldest go first), of at
most ``max_per_room`` messages each. What the bounds or the timeout drop is
returned to the table (:class:`Dropped`), which refuses each request among
it (its receiver fails at once): nothing is dropped silently.

The table calls it under the rank's lock, from the control thread (or the
scheduler's, creating a sender). Nothing blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from transfer.messages import TransferRequest


@dataclass(frozen=True)
class Dropped:
    """Messages dropped before their room's sender existed, and why."""

    messages: tuple
    why: str


class EarlyMessages:
    """Messages kept by room, with the (monotonic) time each arrived. Not
    thread-safe: the table calls it under its lock."""

    def __init__(self, max_rooms: int, max_per_room: int) -> None:
        self.max_rooms, self.max_per_room = max_rooms, max_per_room
        self._rooms: dict[int, list[tuple[float, object]]] = {}  # insertion order = age

    def __len__(self) -> int:
        """The rooms with messages kept."""
        return len(self._rooms)

    def keep(self, msg, now: float, horizon: float) -> list[Dropped]:
        """Keep ``msg``, which arrived at ``now``, within the bounds: with
        ``max_rooms`` rooms kept, those whose newest message is older than
        ``horizon`` go first, then the oldest rooms. Returns what was
        dropped, in order (``msg`` itself when its room is full)."""
        dropped = []
        if len(self._rooms) >= self.max_rooms:
            for room in [r for r, msgs in self._rooms.items() if not msgs or msgs[-1][0] < horizon]:
                dropped.append(self._drop(room, "waited for its sender longer than the bootstrap timeout"))
            while len(self._rooms) >= self.max_rooms:
                dropped.append(self._drop(next(iter(self._rooms)),
                                          f"more than {self.max_rooms} rooms wait for their sender"))
        kept = self._rooms.setdefault(msg.room, [])
        if len(kept) >= self.max_per_room:
            dropped.append(Dropped((msg,), f"more than {self.max_per_room} messages wait for the room's sender"))
            return dropped
        kept.append((now, msg))
        return dropped

    def take(self, room: int, horizon: float) -> tuple[list, Dropped]:
        """The messages kept for ``room``, which its sender now takes (those
        newer than ``horizon``), and those that waited too long; none is kept
        any more."""
        kept = self._rooms.pop(room, [])
        stale = Dropped(tuple(m for t, m in kept if t < horizon),
                        "it waited for its sender longer than the bootstrap timeout")
        return [m for t, m in kept if t >= horizon], stale

    def requests(self, room: int) -> list[TransferRequest]:
        """The requests kept for ``room``."""
        return [m for _, m in self._rooms.get(room, ()) if isinstance(m, TransferRequest)]

    def from_rank(self, req: TransferRequest) -> TransferRequest | None:
        """A request kept for ``req``'s room from the same decode TP rank (None: none)."""
        for _, kept in self._rooms.get(req.room, ()):
            if isinstance(kept, TransferRequest) and kept.decode_tp_rank == req.decode_tp_rank:
                return kept
        return None

    def withdraw(self, room: int, request_id: int) -> list[TransferRequest]:
        """Remove the requests kept for ``room`` with ``request_id`` (an
        abort came for them) and return them."""
        kept = self._rooms.get(room, [])
        withdrawn = []
        for t, msg in list(kept):
            if isinstance(msg, TransferRequest) and msg.request_id == request_id:
                kept.remove((t, msg))
                withdrawn.append(msg)
        if not kept:
            self._rooms.pop(room, None)
        return withdrawn

    def _drop(self, room: int, why: str) -> Dropped:
        return Dropped(tuple(m for _, m in self._rooms.pop(room)), why)
