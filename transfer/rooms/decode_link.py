"""A decode room's link to its prefill DP group (a :class:`~transfer.rooms.links.Link`).

Looked up through the rank's room table until it is ready or failed, it is
then the room's; it is told of the room's abort (before it is known, once it
is); and it is given up once, when every prefill rank the room asked was
found gone before it took the request, so that the room asks the node afresh
(phase RELINKING of :mod:`transfer.rooms.decode_phases`). It also names the
room's prefill peer in messages.

Pure. Its room calls it under ``ctx.lock``, on whatever thread holds it;
nothing here blocks (the table's lookups and sends return at once) and
nothing raises: a failed link is returned for the room to fail with.
"""

from __future__ import annotations

from typing import Protocol
from collections.abc import Callable

from transfer.messages import RoomAbort
from transfer.rooms.links import Link, LinkState


class LinkTable(Protocol):
    """What a room's link needs of the rank's room table
    (:class:`~transfer.rooms.decode_table.DecodeRooms`), under ``ctx.lock``."""

    def link(self, addr: str, node: str, dp_rank: int | None, room: int) -> Link | None: ...

    def forget(self, link: Link) -> None: ...

    def tell_prefill(self, link: Link, msg: RoomAbort, where: str) -> set[int]: ...

    def abort_when_resolved(self, addr: str, node: str, dp_rank: int | None, abort: RoomAbort) -> None: ...


class RoomLink:
    """The link of room ``room`` to prefill node ``node`` (DP rank
    ``dp_rank``; None: the table routes the room) of the bootstrap server at
    ``addr``."""

    def __init__(self, table: LinkTable, addr: str, node: str, dp_rank: int | None, room: int) -> None:
        self._table = table
        self._addr, self._node, self._dp_rank, self._room = addr, node, dp_rank, room
        #: the room's link, once taken (ready, or failed); None again after :meth:`drop`
        self.link: Link | None = None
        #: the link the room looked at last (it may be waiting)
        self.seen: Link | None = None
        #: times the room asked the node afresh (RELINKING)
        self.num_relinks = 0

    def take(self) -> Link | None:
        """Look the link up: once ready or failed it is the room's, and
        returned (a failed one forgotten by the table, so that it is looked
        up afresh; the room fails with its ``error``). None while it is
        being resolved."""
        link = self._table.link(self._addr, self._node, self._dp_rank, self._room)
        self.seen = link
        if link is not None and link.state is LinkState.FAILED:
            self._table.forget(link)
            self.link = link
            return link
        if link is not None and link.state is LinkState.READY:
            self.link = link
            return link
        return None

    @property
    def name(self) -> str:
        """The link's name, for messages: the room's, else the one it looked
        at last (there is one once the room asked for its part)."""
        return (self.link or self.seen).name

    def not_ready(self, timeout_s: float) -> str:
        """Why a room bootstrapping for ``timeout_s`` has no link yet."""
        link = self.seen
        what = link.progress if link is not None else "prefill DP size unknown"
        name = link.name if link is not None else f"prefill node {self._node!r}"
        return f"{name} not ready after {timeout_s:g} s: {what}"

    def handshake_wait(self, since: float, now: float) -> float:
        """How long of ``[since, now]`` the link waited on its handshakes (0: none known yet)."""
        link = self.link or self.seen
        return link.handshake_wait(since, now) if link is not None else 0.0

    @property
    def peer(self) -> str:
        """The prefill sessions the room asked (or, without them, its node
        and DP rank), for its failure line."""
        link = self.link
        if link is not None and link.ranks:
            return ",".join(sorted({link.ranks[p].session for p in link.routes if p in link.ranks}))
        return f"{self._node}/dp{'?' if self._dp_rank is None else self._dp_rank}"

    def ranks_of(self, session: str, ranks: set[int]) -> set[int]:
        """Those of the link's TP ranks ``ranks`` that are prefill session
        ``session`` (none before the link's ranks are known)."""
        link = self.link
        if link is None or not link.ranks:
            return set()
        return {p for p in ranks if link.ranks[p].session == session}

    def tell_abort(self, abort: RoomAbort, where: str) -> set[int]:
        """Tell the link's prefill ranks that the room is over; a link not
        looked up yet is told once it is (a failed lookup has nobody to
        tell). Returns the ranks that could not be told."""
        link = self.link
        if link is not None and link.ranks:
            return self._table.tell_prefill(link, abort, where)
        if link is None:
            self._table.abort_when_resolved(self._addr, self._node, self._dp_rank, abort)
        return set()

    def may_relink(self, lost: set[int], untouched: bool, pending: Callable[[str], bool]) -> bool:
        """Whether the room, transferring, may ask the node afresh, its ranks
        ``lost`` being gone: it never did (once per room), every rank it
        asked is among them, and none of them acknowledged the request
        (``pending(session)``) or sent a word or a byte for it (``untouched``):
        a killed node restarted between its last room and this one (the new
        process registered, the old link was not yet found dead)."""
        link = self.link
        return (not self.num_relinks and set(link.routes) <= lost and untouched
                and all(pending(link.ranks[p].session) for p in link.routes))

    def drop(self) -> None:
        """Give the link up, to ask the node afresh (see :meth:`may_relink`)."""
        self.num_relinks += 1
        self.link = None
