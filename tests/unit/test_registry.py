"""bootstrap.registry.Registry: grouping, readiness, conflicts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.messages import MAX_KNOWN_NODES, LookupReply, Registered
from bootstrap.registry import Registry, RegistryConflict

from ._fixtures import make_rank


def test_unknown_node_is_not_ready_with_dp_size_zero():
    reg = Registry()
    reply = reg.lookup("nobody", 0)
    assert isinstance(reply, LookupReply)
    assert reply.ready is False and reply.dp_size == 0 and reply.tp_size == 0
    assert reply.num_registered == 0 and reply.ranks == ()
    assert reply.node_id == "nobody" and reply.dp_rank == 0
    assert reg.num_nodes == 0


def test_progress_then_ready_ordered_by_tp_rank():
    reg = Registry()
    order = [2, 0, 3, 1]
    for i, r in enumerate(order):
        got = reg.register(make_rank(tp_rank=r, tp_size=4))
        assert isinstance(got, Registered)
        assert got.num_registered == i + 1 and got.tp_size == 4 and got.node_id == "prefill-0"
        reply = reg.lookup("prefill-0", 0)
        if i < 3:
            assert reply.ready is False
            assert reply.ranks == ()
            assert reply.num_registered == i + 1
            assert reply.tp_size == 4 and reply.dp_size == 1
    assert reply.ready is True
    assert reply.num_registered == 4
    assert [r.tp_rank for r in reply.ranks] == [0, 1, 2, 3]
    assert reply.ranks[2] == make_rank(tp_rank=2, tp_size=4)
    assert reg.num_nodes == 1


def test_reregister_replaces():
    reg = Registry()
    reg.register(make_rank(tp_rank=0, tp_size=2))
    reg.register(make_rank(tp_rank=1, tp_size=2))
    restarted = make_rank(tp_rank=1, tp_size=2, session="10.9.9.9:1", control_endpoint="tcp://10.9.9.9:2")
    got = reg.register(restarted)
    assert got.num_registered == 2  # replaced, not added
    reply = reg.lookup("prefill-0", 0)
    assert reply.ready and reply.ranks[1] == restarted and reply.ranks[1].session == "10.9.9.9:1"


def test_reregister_before_ready_does_not_count_twice():
    reg = Registry()
    reg.register(make_rank(tp_rank=0, tp_size=2))
    assert reg.register(make_rank(tp_rank=0, tp_size=2, session="again")).num_registered == 1
    assert reg.lookup("prefill-0", 0).ready is False


def test_conflicting_tp_size():
    reg = Registry()
    reg.register(make_rank(tp_rank=0, tp_size=4))
    with pytest.raises(RegistryConflict, match="tp_size 2 differs from 4"):
        reg.register(make_rank(tp_rank=1, tp_size=2))
    # nothing changed
    reply = reg.lookup("prefill-0", 0)
    assert reply.tp_size == 4 and reply.num_registered == 1


def test_lone_rank_may_restart_with_another_tp_size():
    reg = Registry()
    reg.register(make_rank(tp_rank=0, tp_size=4))
    got = reg.register(make_rank(tp_rank=0, tp_size=2))
    assert got.tp_size == 2 and got.num_registered == 1


def test_conflicting_dp_size():
    reg = Registry()
    reg.register(make_rank(dp_rank=0, dp_size=2))
    with pytest.raises(RegistryConflict, match="dp_size 3 differs from 2"):
        reg.register(make_rank(dp_rank=1, dp_size=3))
    with pytest.raises(RegistryConflict):
        reg.register(make_rank(dp_rank=0, dp_size=1))
    assert reg.lookup("prefill-0", 1).num_registered == 0


def test_registry_conflict_is_value_error():
    assert issubclass(RegistryConflict, ValueError)


def test_dp_groups_are_independent():
    reg = Registry()
    reg.register(make_rank(dp_rank=0, dp_size=2, tp_rank=0, tp_size=1))
    reg.register(make_rank(dp_rank=1, dp_size=2, tp_rank=0, tp_size=2))
    r0, r1 = reg.lookup("prefill-0", 0), reg.lookup("prefill-0", 1)
    assert r0.ready and r0.tp_size == 1 and r0.ranks[0].dp_rank == 0
    assert not r1.ready and r1.tp_size == 2 and r1.num_registered == 1
    assert r0.dp_size == r1.dp_size == 2
    reg.register(make_rank(dp_rank=1, dp_size=2, tp_rank=1, tp_size=2))
    r1 = reg.lookup("prefill-0", 1)
    assert r1.ready and [(r.dp_rank, r.tp_rank) for r in r1.ranks] == [(1, 0), (1, 1)]
    assert reg.lookup("prefill-0", 0).ranks == r0.ranks


def test_known_node_unregistered_dp_group_not_ready():
    reg = Registry()
    reg.register(make_rank(dp_rank=0, dp_size=2))
    reply = reg.lookup("prefill-0", 1)
    assert reply.ready is False and reply.dp_size == 2 and reply.num_registered == 0 and reply.ranks == ()


def test_lookup_dp_rank_beyond_dp_size_raises():
    reg = Registry()
    reg.register(make_rank(dp_rank=0, dp_size=2))
    with pytest.raises(RegistryConflict, match="no dp rank 2"):
        reg.lookup("prefill-0", 2)


def test_nodes_are_independent():
    reg = Registry()
    reg.register(make_rank(node_id="a", tp_size=1))
    reg.register(make_rank(node_id="b", tp_rank=0, tp_size=2, dp_size=3))
    assert reg.num_nodes == 2
    assert reg.lookup("a", 0).ready
    assert not reg.lookup("b", 0).ready and reg.lookup("b", 0).dp_size == 3


def test_ttl_drops_ranks_not_registered_again():
    reg = Registry(ttl_s=10.0)
    reg.register(make_rank(tp_rank=0, tp_size=2), now=0.0)
    reg.register(make_rank(tp_rank=1, tp_size=2), now=1.0)
    assert reg.lookup("prefill-0", 0, now=9.0).ready
    reg.register(make_rank(tp_rank=1, tp_size=2), now=9.0)  # rank 1 keeps re-registering, rank 0 died
    reply = reg.lookup("prefill-0", 0, now=10.5)
    assert not reply.ready and reply.num_registered == 1 and reg.num_expired == 1
    reg.register(make_rank(tp_rank=0, tp_size=2), now=11.0)  # restarted
    assert reg.lookup("prefill-0", 0, now=11.0).ready
    assert reg.lookup("prefill-0", 0, now=30.0).dp_size == 0  # everyone gone: the node is forgotten
    assert reg.num_nodes == 0


def test_ttl_zero_keeps_ranks_forever():
    reg = Registry()
    reg.register(make_rank(tp_rank=0, tp_size=1), now=0.0)
    assert reg.lookup("prefill-0", 0, now=1e9).ready


def test_unregister_drops_only_the_registered_session():
    reg = Registry()
    rank = make_rank(tp_rank=0, tp_size=2)
    reg.register(rank)
    reg.register(make_rank(tp_rank=1, tp_size=2))
    stale = reg.unregister(rank.node_id, 0, 0, "some-older-session")
    assert stale.removed is False and stale.num_registered == 2
    assert reg.lookup(rank.node_id, 0).ready is True
    gone = reg.unregister(rank.node_id, 0, 0, rank.session)
    assert gone.removed is True and gone.num_registered == 1
    reply = reg.lookup(rank.node_id, 0)
    assert reply.ready is False and reply.num_registered == 1
    assert reg.unregister(rank.node_id, 0, 0, rank.session).removed is False  # twice: a no-op
    assert reg.unregister("nobody", 3, 1, "s").num_registered == 0


def test_unregistering_the_last_rank_forgets_the_node():
    reg = Registry()
    rank = make_rank()
    reg.register(rank)
    reg.unregister(rank.node_id, rank.dp_rank, rank.tp_rank, rank.session)
    assert reg.num_nodes == 0 and reg.num_ranks == 0 and reg.known_nodes() == ()


def test_unknown_node_only_after_the_grace_time():
    reg = Registry(node_grace_s=4.0, started_at=100.0)
    reg.register(make_rank(node_id="prefill-0"), now=100.5)
    early = reg.lookup("prefil-0", 0, now=103.9)
    assert early.unknown_node is False and early.known_nodes == () and early.ready is False
    late = reg.lookup("prefil-0", 0, now=104.0)
    assert late.unknown_node is True and late.ready is False and late.known_nodes == ("prefill-0",)
    assert reg.lookup("prefill-0", 0, now=105.0).unknown_node is False  # a known node is never unknown
    assert Registry().lookup("x", 0, now=1e9).unknown_node is False  # no grace configured: never unknown


def test_known_nodes_are_bounded_and_sorted():
    reg = Registry(node_grace_s=0.0)
    for i in range(MAX_KNOWN_NODES + 10):
        reg.register(make_rank(node_id=f"n{i:03d}"))
    reply = reg.lookup("missing", 0, now=1.0)
    assert reply.unknown_node and reply.known_nodes == tuple(f"n{i:03d}" for i in range(MAX_KNOWN_NODES))


def test_version_moves_only_when_lookups_may_change():
    reg = Registry(ttl_s=10.0)
    rank = make_rank()
    reg.register(rank, now=0.0)
    v = reg.version
    reg.register(rank, now=1.0)  # a re-registration of the same rank
    assert reg.version == v
    reg.register(make_rank(session="restarted:1"), now=2.0)
    assert reg.version == v + 1
    reg.expire(now=20.0)
    assert reg.version == v + 2 and reg.num_ranks == 0


def test_entries_are_ordered_with_their_age():
    reg = Registry()
    reg.register(make_rank(node_id="b", tp_rank=1, tp_size=2), now=5.0)
    reg.register(make_rank(node_id="b", tp_rank=0, tp_size=2), now=7.0)
    reg.register(make_rank(node_id="a"), now=8.0)
    got = [(r.node_id, r.tp_rank, age) for r, age in reg.entries(now=10.0)]
    assert got == [("a", 0, 2.0), ("b", 0, 3.0), ("b", 1, 5.0)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["register", "unregister", "expire"]), st.sampled_from(["a", "b"]),
                          st.integers(0, 2), st.sampled_from([2, 3]), st.sampled_from(["s1", "s2"])), max_size=40))
def test_num_ranks_always_counts_the_entries(ops):
    reg = Registry(ttl_s=5.0)
    for now, (op, node, tp, tp_size, session) in enumerate(ops):
        if op == "register" and tp < tp_size:
            try:
                reg.register(make_rank(node_id=node, tp_rank=tp, tp_size=tp_size, session=session), now=now)
            except RegistryConflict:
                pass
        elif op == "unregister":
            reg.unregister(node, 0, tp, session)
        else:
            reg.expire(now)
        entries = reg.entries(now)  # expires first
        assert reg.num_ranks == len(entries)


def test_partial_lookup_lists_the_ranks_registered_so_far():
    reg = Registry()
    for r in (3, 1):
        reg.register(make_rank(tp_rank=r, tp_size=4))
    assert reg.lookup("prefill-0", 0).ranks == ()  # a plain lookup waits for the whole group
    reply = reg.lookup("prefill-0", 0, partial=True)
    assert not reply.ready and reply.num_registered == 2 and reply.tp_size == 4
    assert [r.tp_rank for r in reply.ranks] == [1, 3] and reply.departed == ()


def test_a_rank_that_leaves_is_departed_until_it_registers_again():
    reg = Registry(ttl_s=10.0)
    for r in range(4):
        reg.register(make_rank(tp_rank=r, tp_size=4), now=0.0)
    assert reg.lookup("prefill-0", 0, 0.0, partial=True).departed == ()  # ready: nobody left
    assert reg.unregister("prefill-0", 0, 2, make_rank(tp_rank=2, tp_size=4).session).removed
    for r in (0, 1, 3):  # rank 3 is not heard of again: it expires
        reg.register(make_rank(tp_rank=r, tp_size=4), now=5.0 if r != 3 else 0.0)
    reply = reg.lookup("prefill-0", 0, 12.0, partial=True)
    assert not reply.ready and [r.tp_rank for r in reply.ranks] == [0, 1] and reply.departed == (2, 3)
    assert reg.lookup("prefill-0", 0, 12.0).departed == ()  # only partial lookups are told
    reg.register(make_rank(tp_rank=2, tp_size=4, session="restarted:1"), now=12.0)
    assert reg.lookup("prefill-0", 0, 12.0, partial=True).departed == (3,)


def test_a_group_whose_last_rank_left_is_gone_departures_and_all():
    reg = Registry(node_grace_s=0.0)
    reg.register(make_rank(tp_rank=0, tp_size=2))
    reg.unregister("prefill-0", 0, 0, make_rank(tp_rank=0, tp_size=2).session)
    reply = reg.lookup("prefill-0", 0, 1.0, partial=True)
    assert reply.unknown_node and reply.ranks == () and reply.departed == ()
