"""The rank's room changes as scheduler loops read them: the rank's
:class:`~transfer.changes.ChangeLog` (the rule: every change of a room's
state is one entry, read by marks) behind the rank's lock, and the wait for
the next change, for :class:`~transfer.manager.KVManager`'s ``progress``,
``changed_rooms`` and ``wait_for_progress``."""

from __future__ import annotations

import threading

from transfer.changes import ChangeLog


class ChangeFeed:
    """One rank's changes, under ``lock`` (the rank's re-entrant lock).

    Threads: :meth:`changed` by the room layer (``RoomContext.changed``),
    with the lock held, once per change of a room's state; never blocks.
    :meth:`since` from any thread (it takes the lock); :attr:`progress` from
    any thread, without it (a racy read of one int). :meth:`wait` from a
    scheduler's thread: it blocks, the lock released, until a change after
    its mark or its timeout. Nothing here raises. Each reader keeps its own
    mark; nothing is consumed."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._progress = threading.Condition(lock)
        self._changes = ChangeLog()

    def changed(self, room=None, state=None) -> None:
        """``room`` (a sender or receiver; None: some room) changed to
        ``state`` (called with the lock held)."""
        self._changes.record(room, state)
        self._progress.notify_all()

    @property
    def progress(self) -> int:
        """A mark that grows by one whenever any room of the rank changes state."""
        return self._changes.progress

    def since(self, mark: int) -> tuple[int, list | None]:
        """``(progress, changes)``: the rooms that changed state after the
        mark ``mark`` (a :attr:`progress` value), as ``(room, state)`` pairs
        oldest first (``room`` is the KVSender or KVReceiver; a room may
        appear more than once; ``state`` is what it changed to, call its
        ``poll()`` for what it is now). ``changes`` is None when the caller
        fell more than 65,536 changes behind: poll every room then. Cost:
        O(changes returned); never blocks beyond the rank's lock.

        Every state change is in the log, timeouts included: the rank's
        peer watch polls live rooms every
        :data:`~transfer.rank.watch.SWEEP_INTERVAL_S`, so a scheduler that
        polls only changed rooms still sees them fail."""
        with self._lock:
            return self._changes.since(mark)

    def wait(self, seen: int, timeout_s: float) -> int:
        """Block until :attr:`progress` exceeds ``seen`` or ``timeout_s``
        passed; returns :attr:`progress`."""
        with self._progress:
            self._progress.wait_for(lambda: self._changes.progress > seen, timeout_s)
            return self._changes.progress
