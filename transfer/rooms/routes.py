"""Decode side: what each prefill rank of a DP group sends to this decode
rank for every room (pure planning: no thread, no socket).

From this rank's :class:`~bootstrap.messages.RankInfo`, the group's pools and
its TP size, :func:`plan_routes` names, per prefill rank this rank asks, the
pools it sends and their head slices (:mod:`transfer.tp`), how many decode
requests that rank awaits per room, the rank that sends the aux row, and the
ranks that send each state pool (:mod:`transfer.state_slices`).
"""

from __future__ import annotations

from dataclasses import dataclass

from bootstrap.messages import AttentionKind, PoolDescriptor, PoolRole, RankInfo
from transfer import tp
from transfer.errors import IncompatibleLayoutError
from transfer.messages import PoolAssignment
from transfer.state_slices import senders as state_senders


@dataclass(frozen=True)
class Routes:
    """One room's routes from a prefill DP group to this decode rank."""

    #: prefill TP rank -> what it sends (one assignment per pool this rank holds)
    assignments: dict[int, tuple[PoolAssignment, ...]]
    #: prefill TP rank -> how many decode ranks' requests it awaits per room
    num_requests: dict[int, int]
    aux_rank: int  # the prefill rank that sends the aux row (the first that sends the target)
    state_ranks: tuple[tuple[int, ...], ...]  # per state pool of this rank: the prefill ranks that send it


def plan_routes(local: RankInfo, pools: tuple[PoolDescriptor, ...], prefill_tp: int) -> Routes:
    """The routes to a group of ``prefill_tp`` ranks holding ``pools`` (every
    rank of a group holds the same pools). Raises IncompatibleLayoutError
    when a state pool would come from a rank this rank does not ask."""
    decode_tp = local.tp_size
    shapes = tuple(
        tp.PoolShape(role=p.role, is_mla=p.attention is AttentionKind.MLA, total_heads=p.total_kv_heads)
        for p in pools if local.pool(p.role) is not None)
    routes = tp.room_routes(local.tp_rank, prefill_tp, decode_tp, shapes)
    assignments = {
        p: tuple(PoolAssignment(role=role, send=s is not None,
                                src_head_offset=s.src_head_offset if s else 0,
                                dst_head_offset=s.dst_head_offset if s else 0,
                                num_heads=s.num_heads if s else 0)
                 for role, s in by_role.items())
        for p, by_role in routes.items()}
    aux_rank = [p for p, by_role in routes.items() if by_role.get(PoolRole.TARGET)][0]
    # A replicated state comes from the rank that sends the aux row; a sharded one from the prefill
    # ranks whose share of it overlaps this rank's (transfer.state_slices).
    state_ranks = tuple(state_senders(s, aux_rank, prefill_tp, local.tp_rank, decode_tp) for s in local.states)
    for s, ranks in zip(local.states, state_ranks, strict=True):
        if any(p not in routes for p in ranks):
            raise IncompatibleLayoutError(f"states.{s.kind}.tp_size", prefill_tp, decode_tp,
                                          detail=f"state {s.kind} would come from prefill ranks {list(ranks)}, "
                                                 f"this rank asks {sorted(routes)} for the target")
    return Routes(assignments=assignments, num_requests={p: tp.num_requests(p, prefill_tp, decode_tp, shapes)
                                                         for p in routes},
                  aux_rank=aux_rank, state_ranks=state_ranks)
