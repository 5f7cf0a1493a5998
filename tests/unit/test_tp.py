"""transfer.tp: exhaustive checks over prefill TP x decode TP x KV heads."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from bootstrap.messages import PoolRole
from transfer import tp
from transfer.tp import HeadRange, HeadSlice, PoolShape

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 3, 4, 6, 8, 12, 16, 32)


def valid(total: int, size: int) -> bool:
    if total >= size:
        return total % size == 0
    return size % total == 0


def global_heads(rank: int, size: int, total: int) -> list[int]:
    """Independent model: split heads, or replicate each head on size/total ranks."""
    if total >= size:
        per = total // size
        return list(range(rank * per, rank * per + per))
    return [rank * total // size]


# --- check_tp / heads_of ------------------------------------------------------------


@pytest.mark.parametrize("size", TPS)
@pytest.mark.parametrize("total", HEADS)
def test_check_tp_and_heads_of(total, size):
    if not valid(total, size):
        with pytest.raises(ValueError):
            tp.check_tp(total, size)
        with pytest.raises(ValueError):
            tp.heads_of(0, size, total)
        return
    tp.check_tp(total, size)
    holders = Counter()
    for r in range(size):
        hr = tp.heads_of(r, size, total)
        assert isinstance(hr, HeadRange)
        assert list(range(hr.start, hr.start + hr.count)) == global_heads(r, size, total)
        holders.update(range(hr.start, hr.start + hr.count))
    assert set(holders) == set(range(total))
    assert set(holders.values()) == {max(1, size // total)}
    with pytest.raises(ValueError):
        tp.heads_of(size, size, total)
    with pytest.raises(ValueError):
        tp.heads_of(-1, size, total)


@pytest.mark.parametrize("total, size", [(3, 2), (6, 4), (2, 3), (4, 6), (0, 1), (1, 0), (-2, 2), (5, 8)])
def test_check_tp_rejects(total, size):
    with pytest.raises(ValueError):
        tp.check_tp(total, size)


# --- mha_sources ------------------------------------------------------------------


def check_slices(slices, decode_rank, prefill_tp, decode_tp, total):
    """Slices cover exactly the decode rank's heads, once, each within its source's heads."""
    want = global_heads(decode_rank, decode_tp, total)
    got = []
    for s in slices:
        assert isinstance(s, HeadSlice)
        assert 0 <= s.prefill_rank < prefill_tp
        assert s.num_heads >= 1
        src = global_heads(s.prefill_rank, prefill_tp, total)
        assert 0 <= s.src_head_offset and s.src_head_offset + s.num_heads <= len(src), "slice outside source"
        assert 0 <= s.dst_head_offset and s.dst_head_offset + s.num_heads <= len(want), "slice outside dest"
        for i in range(s.num_heads):
            g = src[s.src_head_offset + i]
            assert want[s.dst_head_offset + i] == g, "head lands at the wrong destination offset"
            got.append(g)
    assert sorted(got) == want and len(got) == len(set(got)), f"heads {got} != {want}"


CASES = [(p, d, h) for p, d, h in itertools.product(TPS, TPS, HEADS)]


@pytest.mark.parametrize("prefill_tp, decode_tp, total", CASES)
def test_mha_sources_cover_exactly(prefill_tp, decode_tp, total):
    if not (valid(total, prefill_tp) and valid(total, decode_tp)):
        with pytest.raises(ValueError):
            tp.mha_sources(0, prefill_tp, decode_tp, total)
        return
    for d in range(decode_tp):
        slices = tp.mha_sources(d, prefill_tp, decode_tp, total)
        check_slices(slices, d, prefill_tp, decode_tp, total)
        # one slice per feeding prefill rank (maximally merged)
        ranks = [s.prefill_rank for s in slices]
        assert len(ranks) == len(set(ranks))


def test_mha_sources_examples():
    # prefill tp 2 (4 heads each) -> decode tp 1 (8 heads): two slices
    assert tp.mha_sources(0, 2, 1, 8) == (HeadSlice(0, 0, 0, 4), HeadSlice(1, 0, 4, 4))
    # prefill tp 1 (8 heads) -> decode tp 4 (2 heads each): rank 3 takes heads 6,7
    assert tp.mha_sources(3, 1, 4, 8) == (HeadSlice(0, 6, 0, 2),)
    # prefill tp 2 -> decode tp 4, 8 heads: decode rank 1 = heads 2,3 = prefill 0 offsets 2..3
    assert tp.mha_sources(1, 2, 4, 8) == (HeadSlice(0, 2, 0, 2),)
    # GQA replication: 2 heads over prefill tp 4 (each head on 2 ranks); decode tp 1 wants both
    for s in tp.mha_sources(0, 4, 1, 2):
        assert s.num_heads == 1


def test_replicas_are_spread_over_decode_ranks():
    # 1 KV head replicated on 8 prefill ranks, 8 decode ranks: each decode
    # rank may take it from a different replica
    sources = {tp.mha_sources(d, 8, 8, 1)[0].prefill_rank for d in range(8)}
    assert sources == set(range(8))


@pytest.mark.parametrize("p, d", [(3, 2), (2, 3), (6, 4), (4, 6), (8, 3), (0, 1), (1, 0)])
def test_non_dividing_tp_pairs(p, d):
    with pytest.raises(ValueError):
        tp.check_tp_pair(p, d)
    with pytest.raises(ValueError):
        tp.mla_source(0, p, d)
    with pytest.raises(ValueError):
        tp.home_decode_rank(0, p, d)
    with pytest.raises(ValueError):
        tp.mha_sources(0, p, d, 12)


def test_non_dividing_pair_num_requests():
    with pytest.raises(ValueError):
        tp.num_requests(0, 3, 2, (PoolShape(PoolRole.TARGET, False, 6),))


# --- room_routes / num_requests -----------------------------------------------------


def pool_mixes(total):
    T, D = PoolRole.TARGET, PoolRole.DRAFT
    yield (PoolShape(T, False, total),)
    yield (PoolShape(T, True, 1),)
    yield (PoolShape(T, True, 1), PoolShape(D, False, total))
    yield (PoolShape(T, False, total), PoolShape(D, True, 1))
    for h2 in (1, 2, 8):
        yield (PoolShape(T, False, total), PoolShape(D, False, h2))


ROUTE_CASES = [(p, d, h) for p, d, h in itertools.product(TPS, TPS, (1, 2, 4, 8, 16, 32))]


@pytest.mark.parametrize("prefill_tp, decode_tp, total", ROUTE_CASES)
def test_room_routes(prefill_tp, decode_tp, total):
    for pools in pool_mixes(total):
        if any(not p.is_mla and not (valid(p.total_heads, prefill_tp) and valid(p.total_heads, decode_tp))
               for p in pools):
            continue
        roles = [p.role for p in pools]
        contacted = Counter()
        for d in range(decode_tp):
            routes = tp.room_routes(d, prefill_tp, decode_tp, pools)
            assert list(routes) == sorted(routes)
            contacted.update(list(routes))
            for p, per_pool in routes.items():
                assert 0 <= p < prefill_tp
                assert list(per_pool) == roles
                # a contacted rank either sends something or has d as its home
                assert any(v is not None for v in per_pool.values()) or p % decode_tp == d
            # every prefill rank whose home is d is contacted by d
            assert {p for p in range(prefill_tp) if tp.home_decode_rank(p, prefill_tp, decode_tp) == d} <= set(routes)
            for pool in pools:
                sent = [(p, s) for p, per in routes.items() if (s := per[pool.role]) is not None]
                for p, s in sent:
                    assert s.prefill_rank == p
                if pool.is_mla:
                    assert len(sent) == 1, f"MLA pool sent by {len(sent)} ranks to decode {d}"
                    p, s = sent[0]
                    assert s == HeadSlice(p, 0, 0, 1)
                    assert p == tp.mla_source(d, prefill_tp, decode_tp)
                else:
                    check_slices([s for _, s in sent], d, prefill_tp, decode_tp, pool.total_heads)
                    assert tuple(s for _, s in sent) == tp.mha_sources(d, prefill_tp, decode_tp, pool.total_heads)
        # every prefill rank hears from at least one decode rank, so it reaches a terminal state
        assert set(contacted) == set(range(prefill_tp))
        for p in range(prefill_tp):
            n = tp.num_requests(p, prefill_tp, decode_tp, pools)
            assert n == contacted[p] >= 1


@pytest.mark.parametrize("prefill_tp, decode_tp", list(itertools.product(TPS, TPS)))
def test_mla_one_sender_per_decode_rank(prefill_tp, decode_tp):
    senders = [tp.mla_source(d, prefill_tp, decode_tp) for d in range(decode_tp)]
    assert all(0 <= s < prefill_tp for s in senders)
    # when decode has at least as many ranks, every prefill rank sends to someone
    if decode_tp >= prefill_tp:
        assert set(senders) == set(range(prefill_tp))


def test_contacted_prefill_ranks():
    # prefill tp 4, decode tp 2: decode 0 is home of prefill 0 and 2
    assert tp.contacted_prefill_ranks(0, 4, 2, set()) == (0, 2)
    assert tp.contacted_prefill_ranks(1, 4, 2, {0}) == (0, 1, 3)


def test_routes_example_mla_prefill_tp4_decode_tp1():
    pools = (PoolShape(PoolRole.TARGET, True, 1),)
    routes = tp.room_routes(0, 4, 1, pools)
    assert routes == {0: {PoolRole.TARGET: HeadSlice(0, 0, 0, 1)}, 1: {PoolRole.TARGET: None},
                      2: {PoolRole.TARGET: None}, 3: {PoolRole.TARGET: None}}
    assert [tp.num_requests(p, 4, 1, pools) for p in range(4)] == [1, 1, 1, 1]


def test_num_requests_example_prefill_tp1_decode_tp4():
    pools = (PoolShape(PoolRole.TARGET, False, 8),)
    assert tp.num_requests(0, 1, 4, pools) == 4
