"""Bootstrap wire messages and the descriptors of a rank's KV pools.

The descriptors (:class:`PoolDescriptor`, :class:`AuxDescriptor`,
:class:`RankInfo`) are what a prefill rank registers and what a decode rank
reads back; the transfer layer sends the same structs peer to peer. Each
buffer is named explicitly by (pool role, layer, component); nothing is paired
by position.

Request/reply pairs served by the bootstrap server::

    Register   -> Registered | ErrorReply
    Unregister -> Unregistered | ErrorReply
    Lookup     -> LookupReply (ready, not ready, or unknown node) | ErrorReply
    Status     -> StatusReply (in :mod:`bootstrap.status`)
    Ping       -> Pong
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bootstrap.codec import message, struct
from bootstrap.descriptors import (_MAX_NAME, OMIT_DEFAULT, AttentionKind, AuxDescriptor, BufferRef,  # noqa: F401
                                   Component, KVLayout, PageLayout, PoolDescriptor, PoolRole, StagingDescriptor,
                                   StateBuffer, StatePoolDescriptor, StateSharding,
                                   _check_name, _components, _require, components_of)

#: At most this many node ids are named in an unknown-node reply.
MAX_KNOWN_NODES = 32


@struct
@dataclass(frozen=True)
class RankInfo:
    """What a rank tells others about itself: where it is and what it holds.
    ``fenced``: a decode rank whose pools are not writable by peers (the
    write fence): every byte for it goes through its staging arenas.
    ``transport``: the transfer engine its session belongs to (``mooncake``,
    ``nixl``; both sides of a room must use the same one). ``states``: its
    per-request state pools, in order (state pool ``i`` is sent to state
    pool ``i``)."""

    node_id: str
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    session: str
    control_endpoint: str
    pools: tuple[PoolDescriptor, ...]
    #: the aux regions, in order (empty: none); None or one descriptor is
    #: taken as no region or that one region
    aux: tuple[AuxDescriptor, ...] = ()
    staging: StagingDescriptor | None = None
    fenced: bool = False
    transport: str = field(default="mooncake", metadata=OMIT_DEFAULT)
    states: tuple[StatePoolDescriptor, ...] = field(default=(), metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        _check_name(self.transport, "transport")
        kinds = [s.kind for s in self.states]
        _require(len(kinds) == len(set(kinds)), "at most one state pool per kind")
        if self.aux is None or isinstance(self.aux, AuxDescriptor):
            object.__setattr__(self, "aux", () if self.aux is None else (self.aux,))
        _check_name(self.node_id, "node_id")
        _require(not self.fenced or self.staging is not None, "a fenced rank needs staging")
        _check_name(self.session, "session")
        _check_name(self.control_endpoint, "control_endpoint")
        _require(0 <= self.tp_rank < self.tp_size, f"tp_rank {self.tp_rank} not in [0, {self.tp_size})")
        _require(0 <= self.dp_rank < self.dp_size, f"dp_rank {self.dp_rank} not in [0, {self.dp_size})")
        roles = [p.role for p in self.pools]
        _require(len(roles) == len(set(roles)), "at most one pool per role")
        _require(PoolRole.TARGET in roles, "a rank must have a target pool")

    def pool(self, role: PoolRole) -> PoolDescriptor | None:
        for p in self.pools:
            if p.role is role:
                return p
        return None


# --- bootstrap requests and replies -------------------------------------------------


@message("register")
@dataclass(frozen=True)
class Register:
    """A prefill rank announces itself. Registering the same (node, dp, tp)
    again replaces the entry (a restarted rank)."""

    rank: RankInfo


@message("registered")
@dataclass(frozen=True)
class Registered:
    node_id: str
    dp_rank: int
    num_registered: int
    tp_size: int


@message("lookup")
@dataclass(frozen=True)
class Lookup:
    """Ask for the ranks of DP group ``dp_rank`` of prefill node ``node_id``.
    ``partial``: a not-ready reply also lists the ranks registered so far and
    the ranks that left (a decode rank needs only the prefill ranks its
    routes name, not the whole group)."""

    node_id: str
    dp_rank: int
    partial: bool = field(default=False, metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        _check_name(self.node_id, "node_id")
        _require(self.dp_rank >= 0, f"dp_rank must be >= 0, got {self.dp_rank}")


@message("lookup_reply")
@dataclass(frozen=True)
class LookupReply:
    """``ready`` once all ``tp_size`` ranks of the group registered; until then
    ``num_registered`` tells the progress (a not-ready reply is not an error)
    and ``ranks`` is empty, or, for a ``partial`` lookup, holds the ranks
    registered so far (ordered by TP rank), with ``departed`` the TP ranks
    that were registered and left (unregistered, or silent past the rank TTL)
    and have not registered again. ``dp_size`` is 0 while nothing of the
    node is known.

    ``unknown_node``: no rank of the node is registered although the server
    has been up for its node grace time (every live rank re-registers within
    it), so the name is wrong or the node is down; ``known_nodes`` then lists
    (at most :data:`MAX_KNOWN_NODES` of) the node ids it does know."""

    node_id: str
    dp_rank: int
    ready: bool
    dp_size: int
    tp_size: int
    num_registered: int
    ranks: tuple[RankInfo, ...]
    unknown_node: bool = False
    known_nodes: tuple[str, ...] = ()
    departed: tuple[int, ...] = field(default=(), metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        _require(len(self.known_nodes) <= MAX_KNOWN_NODES, f"known_nodes holds more than {MAX_KNOWN_NODES} ids")
        _require(not (self.unknown_node and self.ready), "an unknown node cannot be ready")
        _require(not self.ready or len(self.ranks) == self.tp_size, "a ready reply lists every rank of the group")
        _require(not (self.ready and self.departed), "a ready reply has no departed ranks")


@message("unregister")
@dataclass(frozen=True)
class Unregister:
    """A closing prefill rank leaves at once. The server drops the entry only
    if ``session`` is the one registered, so the late close of an old process
    cannot remove the rank that has replaced it."""

    node_id: str
    dp_rank: int
    tp_rank: int
    session: str

    def __post_init__(self) -> None:
        _check_name(self.node_id, "node_id")
        _check_name(self.session, "session")
        _require(self.dp_rank >= 0, f"dp_rank must be >= 0, got {self.dp_rank}")
        _require(self.tp_rank >= 0, f"tp_rank must be >= 0, got {self.tp_rank}")


@message("unregistered")
@dataclass(frozen=True)
class Unregistered:
    """``removed``: the entry was there with that session and is gone;
    ``num_registered``: ranks of the group still registered."""

    node_id: str
    dp_rank: int
    tp_rank: int
    removed: bool
    num_registered: int


@message("ping")
@dataclass(frozen=True)
class Ping:
    pass


@message("pong")
@dataclass(frozen=True)
class Pong:
    num_nodes: int
    num_errors: int


@message("error")
@dataclass(frozen=True)
class ErrorReply:
    """The request could not be served; ``code`` is machine-readable
    (``protocol``, ``conflict``, ``internal``), ``message`` says why."""

    code: str
    message: str
