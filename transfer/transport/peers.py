"""The ways a transport opened to its peers: a state table over
:class:`PeerState`. Pure: no threads, no engine, no clock of its own.

The rule (docs/reliability.md, "Opening a peer"): no plan's first write to a
peer runs the engine's handshake. Before a plan goes to a peer, the
transport *opens* it (Mooncake: the peer's segment descriptor, and on RDMA
its endpoints; NIXL: the peer agent's metadata and connection) on its
``kvferry-opener`` thread, bounded by its own deadline; plans to a peer
wait until it is open, and fail with a
:class:`~transfer.errors.HandshakeError` when it could not be opened::

    (unknown) --open asked--> OPENING --engine opened it--> OPEN
                                      --error, or past its deadline--> FAILED
    FAILED --open asked again--> OPENING        (no peer is refused for good)
    OPEN --asked with new metadata--> OPENING   (a fenced decode rank's new arena)

While a peer is OPENING its new plans wait, so that none is checked against
metadata older than what the peer last announced. An open that ended after
its deadline (the engine call returned late) does not change the state: its
attempt is stale. A restarted peer has a new session: a new entry.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from collections.abc import Callable

from transfer.errors import HandshakeError, StateError, TransferError


class PeerState(enum.Enum):
    OPENING = "opening"
    OPEN = "open"
    FAILED = "failed"

    __hash__ = object.__hash__


_NEXT: dict[PeerState, frozenset[PeerState]] = {
    PeerState.OPENING: frozenset({PeerState.OPEN, PeerState.FAILED}),
    PeerState.OPEN: frozenset({PeerState.OPENING}),
    PeerState.FAILED: frozenset({PeerState.OPENING}),
}

#: What an open's waiters get: None when the peer is open, else why not.
OpenCallback = Callable[[TransferError | None], None]


@dataclass
class PeerLink:
    """One peer as this transport sees it (its attempt now, if opening)."""

    peer: str
    blob: bytes
    state: PeerState
    attempt: int
    started_at: float
    deadline: float
    finished_at: float = 0.0
    error: TransferError | None = None
    waiters: list[OpenCallback] = field(default_factory=list)
    warned: bool = False  # the slow-open warning was logged for this attempt

    def move(self, to: PeerState) -> None:
        if to not in _NEXT[self.state]:
            raise StateError(f"peer {self.peer}: {self.state.value} -> {to.value} is not a legal move")
        self.state = to

    @property
    def open_s(self) -> float:
        """How long the last finished attempt took (0 while opening)."""
        return max(0.0, self.finished_at - self.started_at) if self.finished_at else 0.0


@dataclass(frozen=True)
class Started:
    """An attempt the caller must run: open ``peer`` with ``blob``."""

    peer: str
    blob: bytes
    attempt: int


class PeerTable:
    """Every peer a transport opened or tried to (not thread-safe: the owner locks).

    ``timeout_s`` bounds each attempt. Counters: ``num_opened``,
    ``num_failed`` (attempts that ended in FAILED, timeouts included),
    ``num_timed_out``, ``open_seconds`` (the sum over finished attempts).
    """

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"a peer's open needs a timeout > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.links: dict[str, PeerLink] = {}
        self._attempts = 0
        self.num_opened = 0
        self.num_failed = 0
        self.num_timed_out = 0
        self.open_seconds = 0.0

    def state(self, peer: str) -> PeerState | None:
        link = self.links.get(peer)
        return link.state if link is not None else None

    @property
    def num_opening(self) -> int:
        return sum(1 for link in self.links.values() if link.state is PeerState.OPENING)

    def ask(self, peer: str, blob: bytes, now: float, waiter: OpenCallback | None = None) -> Started | None:
        """Someone needs ``peer`` open (``blob``: what the peer's handshake
        carried). Returns the attempt to start, or None when one runs
        already (``waiter`` joins it) or the peer is open with this blob (or
        ``blob`` is empty): ``waiter`` is not kept then, the caller calls it
        with None, outside its lock. An open peer asked with another blob
        opens again (OPENING: its new plans wait for it)."""
        link = self.links.get(peer)
        if link is not None and link.state is PeerState.OPEN and (not blob or blob == link.blob):
            return None
        if link is not None and link.state is PeerState.OPENING:
            if waiter is not None:
                link.waiters.append(waiter)
            if blob and blob != link.blob:
                link.blob = blob  # the running attempt uses the old one; the peer's update follows (update())
            return None
        self._attempts += 1
        if link is None:
            link = self.links[peer] = PeerLink(peer, blob, PeerState.OPENING, self._attempts, now,
                                               now + self.timeout_s)
        else:
            link.move(PeerState.OPENING)
            link.blob, link.attempt, link.started_at = blob or link.blob, self._attempts, now
            link.deadline, link.finished_at, link.error, link.warned = now + self.timeout_s, 0.0, None, False
        if waiter is not None:
            link.waiters.append(waiter)
        return Started(peer, link.blob, link.attempt)

    def finish(self, peer: str, attempt: int, error: TransferError | None, now: float) -> PeerLink | None:
        """Attempt ``attempt`` ended (``error`` None: the peer is open).
        Returns the link with the waiters to tell (and clears them), or None
        for a stale attempt (it ran past its deadline, or a newer one runs)."""
        link = self.links.get(peer)
        if link is None or link.attempt != attempt or link.state is not PeerState.OPENING:
            return None
        link.move(PeerState.FAILED if error is not None else PeerState.OPEN)
        link.error, link.finished_at = error, now
        self.open_seconds += link.open_s
        if error is None:
            self.num_opened += 1
        else:
            self.num_failed += 1
        return link

    def expire(self, now: float, describe: Callable[[PeerLink], str] = lambda link: "") -> list[PeerLink]:
        """Fail the attempts past their deadline (their waiters are the
        caller's to tell); ``describe`` adds what the engine is doing."""
        late = [link for link in self.links.values() if link.state is PeerState.OPENING and now > link.deadline]
        for link in late:
            what = describe(link)
            self.finish(link.peer, link.attempt, HandshakeError(
                f"the handshake with {link.peer} did not finish within {self.timeout_s:g} s"
                + (f": {what}" if what else ""), peer=link.peer), now)
            self.num_timed_out += 1
        return late

    def slow(self, now: float, after_s: float) -> list[PeerLink]:
        """Attempts opening for more than ``after_s`` and not warned of yet
        (each is returned once per attempt)."""
        slow = [link for link in self.links.values()
                if link.state is PeerState.OPENING and not link.warned and now - link.started_at > after_s]
        for link in slow:
            link.warned = True
        return slow

    def forget(self, peer: str) -> None:
        """Drop a peer that is gone for good (the caller failed what waits for it)."""
        self.links.pop(peer, None)

    def take_waiters(self, link: PeerLink) -> list[OpenCallback]:
        waiters, link.waiters = link.waiters, []
        return waiters
