"""The bootstrap registry: which prefill ranks exist and what they hold. Pure.

Ranks are grouped by (node id, DP rank); a group is ready once all of its
``tp_size`` ranks registered. Every rank of a node must agree on ``dp_size``
and every rank of a group on ``tp_size``.

Liveness: prefill ranks re-register every few seconds (which also
re-populates a restarted server). With ``ttl_s`` set, a rank not heard from
for that long is dropped, so lookups stop handing out a dead rank; a rank
restarted under the same (node, DP, TP) simply replaces its old entry, and
a closing rank unregisters (only its own session's entry: the late close of
an old process cannot remove the rank that replaced it).

Unknown nodes: a lookup of a node with no registered rank is "not ready"
while the registry is younger than ``node_grace_s`` (a restarted server is
re-populated by the ranks' next registrations); after that the node is
unknown, and the reply says so and names the nodes that are known.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bootstrap.messages import MAX_KNOWN_NODES, LookupReply, RankInfo, Registered, Unregistered


class RegistryConflict(ValueError):
    """A registration contradicts what the node's other ranks said."""


@dataclass
class _Group:
    tp_size: int
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    seen: dict[int, float] = field(default_factory=dict)  # tp rank -> when last registered
    departed: set[int] = field(default_factory=set)  # tp ranks that left and did not come back


@dataclass
class _Node:
    dp_size: int
    groups: dict[int, _Group] = field(default_factory=dict)


class Registry:
    """In-memory table of registered prefill ranks. Not thread-safe: the
    server calls it from its one serving thread."""

    def __init__(self, ttl_s: float = 0.0, *, node_grace_s: float | None = None, started_at: float = 0.0) -> None:
        """``ttl_s``: see :meth:`expire`; ``node_grace_s``: how long after
        ``started_at`` (same clock as ``now``) an unregistered node is only
        not ready; None: never unknown."""
        self._nodes: dict[str, _Node] = {}
        self.ttl_s = ttl_s
        self.node_grace_s = node_grace_s
        self.started_at = started_at
        self.num_expired = 0
        self._num_ranks = 0
        self._next_expiry = 0.0
        #: Bumped whenever what a lookup returns may change (replies may be cached by it).
        self.version = 0
        self._node_versions: dict[str, int] = {}

    def _changed(self, node_id: str) -> None:
        self.version += 1
        self._node_versions[node_id] = self.version

    def node_version(self, node_id: str) -> int:
        """Changes whenever what a lookup of ``node_id`` returns may change
        (the registry's version at the node's last change; -1: not known)."""
        return self._node_versions.get(node_id, -1)

    @property
    def num_ranks(self) -> int:
        """Ranks registered now (kept up to date, O(1))."""
        return self._num_ranks

    def known_nodes(self, limit: int = MAX_KNOWN_NODES) -> tuple[str, ...]:
        """Up to ``limit`` registered node ids, sorted."""
        return tuple(sorted(self._nodes)[:limit])

    def entries(self, now: float = 0.0) -> list[tuple[RankInfo, float]]:
        """Every registered rank with the seconds since it last registered,
        ordered by (node, DP rank, TP rank)."""
        self.expire_if_due(now)
        return [(group.ranks[tp], now - group.seen[tp])
                for node_id in sorted(self._nodes) for dp, group in sorted(self._nodes[node_id].groups.items())
                for tp in sorted(group.ranks)]

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def expire_if_due(self, now: float) -> None:
        """:meth:`expire`, at most every ``min(1 s, ttl_s / 8)`` (it scans
        every rank): a dead rank goes between ``ttl_s`` and that much later."""
        if self.ttl_s and now >= self._next_expiry:
            self.expire(now)

    def expire(self, now: float) -> None:
        """Drop ranks not registered again within ``ttl_s`` (0: never)."""
        if not self.ttl_s:
            return
        self._next_expiry = now + min(1.0, self.ttl_s / 8)
        for node_id, node in list(self._nodes.items()):
            for dp, group in list(node.groups.items()):
                for tp_rank in [r for r, t in group.seen.items() if now - t > self.ttl_s]:
                    del group.ranks[tp_rank], group.seen[tp_rank]
                    group.departed.add(tp_rank)
                    self.num_expired += 1
                    self._num_ranks -= 1
                    self._changed(node_id)
                if not group.ranks:
                    del node.groups[dp]
            if not node.groups:
                del self._nodes[node_id]
                self._node_versions.pop(node_id, None)

    def register(self, rank: RankInfo, now: float = 0.0) -> Registered:
        """Add or replace a rank (``now``: a monotonic clock, for the TTL).
        Raises :class:`RegistryConflict` when its ``dp_size`` or ``tp_size``
        disagree with ranks already registered."""
        self.expire_if_due(now)
        node = self._nodes.get(rank.node_id)
        if node is not None and node.dp_size != rank.dp_size:
            raise RegistryConflict(
                f"node {rank.node_id!r}: dp_size {rank.dp_size} differs from {node.dp_size} "
                "registered by its other ranks"
            )
        group = node.groups.get(rank.dp_rank) if node else None
        if group is not None and group.tp_size != rank.tp_size and group.ranks.keys() - {rank.tp_rank}:
            raise RegistryConflict(
                f"node {rank.node_id!r} dp {rank.dp_rank}: tp_size {rank.tp_size} differs from "
                f"{group.tp_size} registered by its other ranks"
            )
        if node is None:
            node = self._nodes[rank.node_id] = _Node(dp_size=rank.dp_size)
        if group is None or group.tp_size != rank.tp_size:
            self._num_ranks -= len(group.ranks) if group else 0
            group = node.groups[rank.dp_rank] = _Group(tp_size=rank.tp_size)
        old = group.ranks.get(rank.tp_rank)
        if old is not rank and old != rank:
            self._changed(rank.node_id)
            self._num_ranks += rank.tp_rank not in group.ranks
        group.ranks[rank.tp_rank] = rank
        group.seen[rank.tp_rank] = now
        group.departed.discard(rank.tp_rank)
        return Registered(
            node_id=rank.node_id,
            dp_rank=rank.dp_rank,
            num_registered=len(group.ranks),
            tp_size=group.tp_size,
        )

    def unregister(self, node_id: str, dp_rank: int, tp_rank: int, session: str) -> Unregistered:
        """Drop a rank at once if it is registered with ``session``."""
        node = self._nodes.get(node_id)
        group = node.groups.get(dp_rank) if node else None
        rank = group.ranks.get(tp_rank) if group else None
        removed = rank is not None and rank.session == session
        if removed:
            del group.ranks[tp_rank], group.seen[tp_rank]
            group.departed.add(tp_rank)
            self._changed(node_id)
            self._num_ranks -= 1
            if not group.ranks:
                del node.groups[dp_rank]
            if not node.groups:
                del self._nodes[node_id]
                self._node_versions.pop(node_id, None)
        return Unregistered(node_id=node_id, dp_rank=dp_rank, tp_rank=tp_rank, removed=removed,
                            num_registered=len(group.ranks) if group else 0)

    def is_unknown(self, node_id: str, now: float) -> bool:
        """No rank of ``node_id`` is registered and the grace time is over."""
        return (node_id not in self._nodes and self.node_grace_s is not None
                and now - self.started_at >= self.node_grace_s)

    def lookup(self, node_id: str, dp_rank: int, now: float = 0.0, *, partial: bool = False) -> LookupReply:
        """The group's ranks ordered by TP rank once all registered; a
        not-ready reply before that (with ``partial``: the ranks registered so
        far and those that left, else none), also for a node not registered
        yet; an ``unknown_node`` reply (see :meth:`is_unknown`). A group whose
        last rank left is gone, departures and all: its node is then unknown."""
        self.expire_if_due(now)
        node = self._nodes.get(node_id)
        group = node.groups.get(dp_rank) if node else None
        if node is not None and dp_rank >= node.dp_size:
            raise RegistryConflict(f"node {node_id!r} has dp_size {node.dp_size}, no dp rank {dp_rank}")
        if group is None:
            unknown = self.is_unknown(node_id, now)
            return LookupReply(
                node_id=node_id, dp_rank=dp_rank, ready=False,
                dp_size=node.dp_size if node else 0, tp_size=0, num_registered=0, ranks=(),
                unknown_node=unknown, known_nodes=self.known_nodes() if unknown else (),
            )
        ready = len(group.ranks) == group.tp_size
        listed = ready or partial
        return LookupReply(
            node_id=node_id, dp_rank=dp_rank, ready=ready, dp_size=node.dp_size,
            tp_size=group.tp_size, num_registered=len(group.ranks),
            ranks=tuple(group.ranks[r] for r in sorted(group.ranks)) if listed else (),
            departed=tuple(sorted(group.departed)) if partial and not ready else (),
        )
