"""The bootstrap registry: which prefill ranks exist and what they hold. Pure.

Ranks are grouped by (node id, DP rank); a group is ready once all of its
``tp_size`` ranks registered. Every rank of a node must agree on ``dp_size``
and every rank of a group on ``tp_size``.

Liveness: prefill ranks re-register every few seconds (which also
re-populates a restarted server). With ``ttl_s`` set, a rank not heard from
for that long is dropped, so lookups stop handing out a dead rank; a rank
restarted under the same (node, DP, TP) simply replaces its old entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bootstrap.messages import LookupReply, RankInfo, Registered


class RegistryConflict(ValueError):
    """A registration contradicts what the node's other ranks said."""


@dataclass
class _Group:
    tp_size: int
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    seen: dict[int, float] = field(default_factory=dict)  # tp rank -> when last registered


@dataclass
class _Node:
    dp_size: int
    groups: dict[int, _Group] = field(default_factory=dict)


class Registry:
    """In-memory table of registered prefill ranks. Not thread-safe: the
    server calls it from its one serving thread."""

    def __init__(self, ttl_s: float = 0.0) -> None:
        self._nodes: dict[str, _Node] = {}
        self.ttl_s = ttl_s
        self.num_expired = 0

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def expire(self, now: float) -> None:
        """Drop ranks not registered again within ``ttl_s`` (0: never)."""
        if not self.ttl_s:
            return
        for node_id, node in list(self._nodes.items()):
            for dp, group in list(node.groups.items()):
                for tp_rank in [r for r, t in group.seen.items() if now - t > self.ttl_s]:
                    del group.ranks[tp_rank], group.seen[tp_rank]
                    self.num_expired += 1
                if not group.ranks:
                    del node.groups[dp]
            if not node.groups:
                del self._nodes[node_id]

    def register(self, rank: RankInfo, now: float = 0.0) -> Registered:
        """Add or replace a rank (``now``: a monotonic clock, for the TTL).
        Raises :class:`RegistryConflict` when its ``dp_size`` or ``tp_size``
        disagree with ranks already registered."""
        self.expire(now)
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
            group = node.groups[rank.dp_rank] = _Group(tp_size=rank.tp_size)
        group.ranks[rank.tp_rank] = rank
        group.seen[rank.tp_rank] = now
        return Registered(
            node_id=rank.node_id,
            dp_rank=rank.dp_rank,
            num_registered=len(group.ranks),
            tp_size=group.tp_size,
        )

    def lookup(self, node_id: str, dp_rank: int, now: float = 0.0) -> LookupReply:
        """The group's ranks ordered by TP rank once all registered; a
        not-ready reply (empty ``ranks``) before that, also for unknown nodes."""
        self.expire(now)
        node = self._nodes.get(node_id)
        group = node.groups.get(dp_rank) if node else None
        if node is not None and dp_rank >= node.dp_size:
            raise RegistryConflict(f"node {node_id!r} has dp_size {node.dp_size}, no dp rank {dp_rank}")
        if group is None:
            return LookupReply(
                node_id=node_id, dp_rank=dp_rank, ready=False,
                dp_size=node.dp_size if node else 0, tp_size=0, num_registered=0, ranks=(),
            )
        ready = len(group.ranks) == group.tp_size
        ranks = tuple(group.ranks[r] for r in range(group.tp_size)) if ready else ()
        return LookupReply(
            node_id=node_id, dp_rank=dp_rank, ready=ready, dp_size=node.dp_size,
            tp_size=group.tp_size, num_registered=len(group.ranks), ranks=ranks,
        )
