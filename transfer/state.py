"""Room state machines: tables over :class:`KVPoll`. Pure.

Both sides move forward only; ``Success`` and ``Failed`` are terminal, and a
failure wins over anything not yet terminal. Illegal moves raise
:class:`~transfer.errors.StateError`.

Prefill (sender)::

    Bootstrapping --all requests from decode--> WaitingForInput
    WaitingForInput --first chunk submitted--> Transferring
    Transferring --last chunk landed, decode told--> Success

Decode (receiver)::

    Bootstrapping --lookup + handshake done--> WaitingForInput
    WaitingForInput --requests sent (init)--> Transferring
    Transferring --every expected completion arrived--> Success
"""

from __future__ import annotations

import enum

from transfer.errors import StateError


class KVPoll(enum.IntEnum):
    """What ``poll()`` returns. Values match SGLang's, where ``Failed`` is the
    smallest so a MIN all-reduce across ranks fails them all."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL = frozenset({KVPoll.Success, KVPoll.Failed})

_NEXT: dict[KVPoll, frozenset[KVPoll]] = {
    KVPoll.Bootstrapping: frozenset({KVPoll.WaitingForInput}),
    KVPoll.WaitingForInput: frozenset({KVPoll.Transferring}),
    KVPoll.Transferring: frozenset({KVPoll.Success}),
    KVPoll.Success: frozenset(),
    KVPoll.Failed: frozenset(),
}


class RoomState:
    """The state of one room on one side. Not thread-safe; the owner locks."""

    __slots__ = ("state", "error", "where", "_on_change")

    def __init__(self, where: str, on_change=None) -> None:
        self.state = KVPoll.Bootstrapping
        self.error: BaseException | None = None
        self.where = where
        self._on_change = on_change  # called after every change of state (dropped once terminal)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def move(self, to: KVPoll) -> None:
        """Advance to ``to``; raises StateError unless the table allows it."""
        if to is KVPoll.Failed:
            raise StateError("use fail() to fail a room")
        if to not in _NEXT[self.state]:
            raise StateError(f"{self.where}: cannot go from {self.state.name} to {to.name}")
        self.state = to
        self._changed()

    def fail(self, error: BaseException) -> bool:
        """Fail unless already terminal; returns whether the state changed.
        The first error is kept."""
        if self.terminal:
            return False
        self.state = KVPoll.Failed
        self.error = error
        self._changed()
        return True

    def _changed(self) -> None:
        """Tell the owner; a terminal state changes no more, so the callback
        (which closes over the owner: a reference cycle) is let go of then."""
        on_change = self._on_change
        if self.state in TERMINAL:
            self._on_change = None
        if on_change is not None:
            on_change()
