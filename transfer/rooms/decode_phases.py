"""The phases of a decode room: a table over :class:`DecodePhase`. Pure.

A receiver is in exactly one phase; each phase says what ``poll()``
reports (:class:`~transfer.state.KVPoll`)::

    BOOTSTRAPPING      Bootstrapping    prefill node looked up, ranks handshaken
    WAITING_FOR_INPUT  WaitingForInput  link ready, init() not called yet
    PREFETCHING        WaitingForInput  init() done, loading leading pages from storage
    TRANSFERRING       Transferring     requests out, waiting for every prefill rank
    RELINKING          Transferring     the prefill rank asked was found gone before it took the
                                        request or wrote a byte: the node is looked up again
                                        (restarted: its new rank is asked, with a new request id)
    DRAINING           Transferring     failed; waiting for prefill ranks (and its own scatters
                                        and storage prefetch) to stop writing
    RESTORING          (unchanged)      failed; loading the room from storage
    SUCCESS            Success          terminal
    FAILED             Failed           terminal

Moves::

    BOOTSTRAPPING -> WAITING_FOR_INPUT -> PREFETCHING -> TRANSFERRING -> SUCCESS
                                      \\---------------> TRANSFERRING
    TRANSFERRING -> DRAINING -> RESTORING -> SUCCESS
    TRANSFERRING -> RELINKING -> TRANSFERRING (once per room)
    PREFETCHING -> DRAINING (failed while a storage batch still loads the pages)
    any live phase -> RESTORING (a failure with nothing left writing)
    any non-terminal phase -> FAILED

``RESTORING`` keeps what ``poll()`` said when the failure happened, so a
room restored from storage goes forward from there to ``Success`` as the
table of :mod:`transfer.state` allows. Illegal moves raise
:class:`~transfer.errors.StateError`; ``FAILED`` wins over anything not
terminal.
"""

from __future__ import annotations

import enum

from transfer.errors import StateError
from transfer.state import KVPoll, RoomState


class DecodePhase(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting for input"
    PREFETCHING = "prefetching"
    TRANSFERRING = "transferring"
    RELINKING = "relinking"
    DRAINING = "draining"
    RESTORING = "restoring"
    SUCCESS = "success"
    FAILED = "failed"

    # Members are singletons: hashed by identity in C (Enum's own hash runs Python code,
    # and phases are looked up in sets on every poll).
    __hash__ = object.__hash__


P = DecodePhase
# KVPoll's forward order (KVPoll(n + 1) builds a member through Enum's Python code)
_SUCCESSOR = {KVPoll.Bootstrapping: KVPoll.WaitingForInput, KVPoll.WaitingForInput: KVPoll.Transferring,
              KVPoll.Transferring: KVPoll.Success}

#: Phases in which the room has not failed yet (a failure may still start).
LIVE = frozenset({P.BOOTSTRAPPING, P.WAITING_FOR_INPUT, P.PREFETCHING, P.TRANSFERRING, P.RELINKING})
#: Phases of a room that failed and is being wound up (drained, restored).
ENDING = frozenset({P.DRAINING, P.RESTORING})
TERMINAL = frozenset({P.SUCCESS, P.FAILED})

_NEXT: dict[DecodePhase, frozenset[DecodePhase]] = {
    P.BOOTSTRAPPING: frozenset({P.WAITING_FOR_INPUT, P.RESTORING}),
    P.WAITING_FOR_INPUT: frozenset({P.PREFETCHING, P.TRANSFERRING, P.RESTORING}),
    P.PREFETCHING: frozenset({P.TRANSFERRING, P.DRAINING, P.RESTORING}),
    P.TRANSFERRING: frozenset({P.SUCCESS, P.DRAINING, P.RESTORING, P.RELINKING}),
    P.RELINKING: frozenset({P.TRANSFERRING, P.RESTORING}),
    P.DRAINING: frozenset({P.RESTORING}),
    P.RESTORING: frozenset({P.SUCCESS}),
    P.SUCCESS: frozenset(),
    P.FAILED: frozenset(),
}

#: What poll() reports in each phase (None: unchanged).
POLL: dict[DecodePhase, KVPoll | None] = {
    P.BOOTSTRAPPING: KVPoll.Bootstrapping, P.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    P.PREFETCHING: KVPoll.WaitingForInput, P.TRANSFERRING: KVPoll.Transferring, P.RELINKING: KVPoll.Transferring,
    P.DRAINING: KVPoll.Transferring, P.RESTORING: None, P.SUCCESS: KVPoll.Success, P.FAILED: KVPoll.Failed,
}


class DecodePhases:
    """One decode room's phase and the :class:`RoomState` it reports. Not
    thread-safe; the owner locks."""

    __slots__ = ("phase", "room")

    def __init__(self, where: str, on_change=None) -> None:
        self.phase = P.BOOTSTRAPPING
        self.room = RoomState(where, on_change=on_change)

    @property
    def where(self) -> str:
        return self.room.where

    @property
    def poll(self) -> KVPoll:
        return self.room.state

    @property
    def error(self) -> BaseException | None:
        return self.room.error

    def move(self, to: DecodePhase) -> None:
        """Advance to ``to``; raises StateError unless the table allows it."""
        if to is P.FAILED:
            raise StateError("use fail() to fail a room")
        if to not in _NEXT[self.phase]:
            raise StateError(f"{self.where}: cannot go from phase {self.phase.value} to {to.value}")
        self.phase = to
        target = POLL[to]
        while target is not None and self.room.state < target:  # forward through state.py's table
            self.room.move(_SUCCESSOR[self.room.state])

    def fail(self, error: BaseException) -> bool:
        """Fail unless terminal; returns whether the phase changed."""
        if self.phase in TERMINAL:
            return False
        self.phase = P.FAILED
        return self.room.fail(error)
