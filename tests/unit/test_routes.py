"""transfer.rooms.routes.plan_routes: what each prefill rank of a group sends
to one decode rank (pure planning, no ranks running)."""

from __future__ import annotations

from bootstrap.messages import AttentionKind, PoolRole
from transfer.rooms.routes import plan_routes

from ._fixtures import make_pool, make_rank, mha_rank


def test_mha_from_two_prefill_ranks_to_one_decode_rank_takes_each_ranks_heads():
    decode = mha_rank(tp_rank=0, tp_size=1, total_heads=8)
    prefill_pools = mha_rank(tp_rank=0, tp_size=2, total_heads=8).pools
    routes = plan_routes(decode, prefill_pools, prefill_tp=2)
    assert sorted(routes.assignments) == [0, 1]
    for p, (a,) in routes.assignments.items():
        assert a.role is PoolRole.TARGET and a.send
        assert (a.src_head_offset, a.dst_head_offset, a.num_heads) == (0, 4 * p, 4)
    assert routes.num_requests == {0: 1, 1: 1}
    assert routes.aux_rank == 0 and routes.state_ranks == ()


def test_mla_to_two_decode_ranks_is_sent_by_one_prefill_rank_to_each():
    mla = [make_pool(attention=AttentionKind.MLA, num_kv_heads=1, total_kv_heads=1, head_dim=576)]
    prefill_pools = make_rank(tp_size=2, pools=mla).pools
    for d in (0, 1):
        routes = plan_routes(make_rank(tp_rank=d, tp_size=2, pools=mla), prefill_pools, prefill_tp=2)
        senders = [p for p, assignments in routes.assignments.items() if any(a.send for a in assignments)]
        assert len(senders) == 1, routes
        assert routes.aux_rank == senders[0]
        # every prefill rank asked awaits this decode rank's request, sender or not
        assert all(routes.num_requests[p] >= 1 for p in routes.assignments)
