"""transfer.plan: descriptor arrays checked by executing them on fake memories.

Each pool's buffers live in a flat fake address space. Source bytes hold
unique ids (their own address), destination bytes start as UNTOUCHED, and
bytes between buffers are GAP. Executing a plan copies ids; the result must
equal what an independent numpy model of the page layout says, byte for byte.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.messages import AttentionKind, AuxDescriptor, Component, PageLayout, components_of
from transfer.plan import PageRuns, TransferPlan, check_pages, coalesce, page_runs, plan_aux, plan_pool

from ._fixtures import make_aux, make_pool

GAP = -2
UNTOUCHED = -1
SRC_BASE = 0x7F12_3400_0000
DST_BASE = 0x7E00_0000_1000


class FlatMemory:
    def __init__(self, pool, *, source: bool) -> None:
        self.lo = min(b.addr for b in pool.buffers)
        hi = max(b.addr + b.nbytes for b in pool.buffers)
        self.data = np.full(hi - self.lo, GAP, dtype=np.int64)
        for b in pool.buffers:
            o = b.addr - self.lo
            self.data[o:o + b.nbytes] = np.arange(b.addr, b.addr + b.nbytes) if source else UNTOUCHED
        self.writes = np.zeros(self.data.size, dtype=np.int64)

    def span(self, addr: int, n: int) -> slice:
        o = addr - self.lo
        assert 0 <= o and o + n <= self.data.size, f"descriptor [{addr:#x}, +{n}) outside the pool"
        s = slice(o, o + n)
        assert (self.data[s] != GAP).all(), f"descriptor [{addr:#x}, +{n}) touches bytes between buffers"
        return s

    def view(self, buf, pool) -> np.ndarray:
        """A buffer as [pages, page_size, heads, head_bytes] (a view into data,
        whatever the page layout in memory)."""
        o = buf.addr - self.lo
        n = pool.num_pages * pool.page_bytes
        flat = self.data[o:o + n]
        hb = pool.head_dim * pool.itemsize
        if pool.page_layout is PageLayout.HND:
            return flat.reshape(pool.num_pages, pool.num_kv_heads, pool.page_size, hb).transpose(0, 2, 1, 3)
        return flat.reshape(pool.num_pages, pool.page_size, pool.num_kv_heads, hb)


def execute(plan: TransferPlan, src_pool, dst_pool) -> np.ndarray:
    assert plan.src_addrs.dtype == plan.dst_addrs.dtype == plan.lengths.dtype == np.uint64
    assert plan.src_addrs.shape == plan.dst_addrs.shape == plan.lengths.shape
    src = FlatMemory(src_pool, source=True)
    dst = FlatMemory(dst_pool, source=False)
    for s, d, n in zip(plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.lengths.tolist()):
        assert n > 0, "zero-length descriptor"
        ss, ds = src.span(s, n), dst.span(d, n)
        dst.data[ds] = src.data[ss]
        dst.writes[ds] += 1
    assert dst.writes.max(initial=0) <= 1, "two descriptors write the same destination byte"
    return dst.data


def expected(src_pool, dst_pool, src_pages, dst_pages, soff=0, doff=0, nh=None) -> np.ndarray:
    nh = src_pool.num_kv_heads if nh is None else nh
    src = FlatMemory(src_pool, source=True)
    dst = FlatMemory(dst_pool, source=False)
    for layer in range(src_pool.num_layers):
        for comp in components_of(src_pool.attention):
            sv = src.view(src_pool.buffer(layer, comp), src_pool)
            dv = dst.view(dst_pool.buffer(layer, comp), dst_pool)
            for sp, dp in zip(src_pages, dst_pages):
                dv[dp, :, doff:doff + nh, :] = sv[sp, :, soff:soff + nh, :]
    return dst.data


def assert_no_dst_overlap(plan: TransferPlan) -> None:
    order = np.argsort(plan.dst_addrs, kind="stable")
    d = plan.dst_addrs[order].astype(object)
    n = plan.lengths[order].astype(object)
    for i in range(len(d) - 1):
        assert d[i] + n[i] <= d[i + 1], "destination ranges overlap"


def assert_coalesced(plan: TransferPlan) -> None:
    s, d, n = (a.astype(object) for a in (plan.src_addrs, plan.dst_addrs, plan.lengths))
    for i in range(len(s) - 1):
        assert not (s[i] + n[i] == s[i + 1] and d[i] + n[i] == d[i + 1]), f"entries {i} and {i + 1} mergeable"


# --- strategies -----------------------------------------------------------------


@st.composite
def page_pairs(draw, n_src: int, n_dst: int):
    k = draw(st.integers(0, min(n_src, n_dst)))
    mode = draw(st.sampled_from(["contiguous", "sorted", "permutation", "runs"]))
    if mode == "contiguous":
        a = draw(st.integers(0, n_src - k))
        b = draw(st.integers(0, n_dst - k))
        return list(range(a, a + k)), list(range(b, b + k))
    if mode == "runs":
        # contiguous on the source, two shuffled runs on the destination
        a = draw(st.integers(0, n_src - k))
        src = list(range(a, a + k))
        dst_sorted = sorted(draw(st.permutations(range(n_dst)))[:k])
        cut = draw(st.integers(0, k))
        return src, dst_sorted[cut:] + dst_sorted[:cut]
    src = draw(st.permutations(range(n_src)))[:k]
    dst = draw(st.permutations(range(n_dst)))[:k]
    if mode == "sorted":
        src, dst = sorted(src), sorted(dst)
    return list(src), list(dst)


@st.composite
def pool_layout(draw, *, num_layers, page_size, heads, head_dim, itemsize, base, attention=AttentionKind.MHA,
                page_layout=PageLayout.NHD):
    num_pages = draw(st.integers(1, 10))
    n = num_layers * len(components_of(attention))
    pb = page_size * heads * head_dim * itemsize
    gaps = draw(st.lists(st.sampled_from([0, 0, 1, 64, pb]), min_size=n, max_size=n))
    return make_pool(
        attention=attention, num_layers=num_layers, page_size=page_size, num_kv_heads=heads, head_dim=head_dim,
        itemsize=itemsize, num_pages=num_pages, base=base, gaps=gaps,
        memory_order=draw(st.permutations(range(n))), tuple_order=draw(st.permutations(range(n))),
        dtype={1: "uint8", 2: "bfloat16", 4: "float32"}[itemsize], page_layout=page_layout,
    )


@st.composite
def whole_page_case(draw):
    attention = draw(st.sampled_from([AttentionKind.MHA, AttentionKind.MHA, AttentionKind.MLA]))
    num_layers = draw(st.integers(1, 3))
    page_size = draw(st.integers(1, 4))
    heads = 1 if attention is AttentionKind.MLA else draw(st.integers(1, 4))
    head_dim = draw(st.integers(1, 5))
    itemsize = draw(st.sampled_from([1, 2, 4]))
    page_layout = PageLayout.NHD if attention is AttentionKind.MLA else draw(st.sampled_from(list(PageLayout)))
    kw = dict(num_layers=num_layers, page_size=page_size, heads=heads, head_dim=head_dim, itemsize=itemsize,
              attention=attention, page_layout=page_layout)
    src = draw(pool_layout(base=SRC_BASE, **kw))
    dst = draw(pool_layout(base=DST_BASE, **kw))
    sp, dp = draw(page_pairs(src.num_pages, dst.num_pages))
    return src, dst, sp, dp


@st.composite
def head_slice_case(draw):
    num_layers = draw(st.integers(1, 3))
    page_size = draw(st.integers(1, 4))
    head_dim = draw(st.integers(1, 4))
    itemsize = draw(st.sampled_from([1, 2, 4]))
    src_heads = draw(st.integers(1, 4))
    dst_heads = draw(st.integers(1, 4))
    nh = draw(st.integers(1, min(src_heads, dst_heads)))
    soff = draw(st.integers(0, src_heads - nh))
    doff = draw(st.integers(0, dst_heads - nh))
    kw = dict(num_layers=num_layers, page_size=page_size, head_dim=head_dim, itemsize=itemsize,
              page_layout=draw(st.sampled_from(list(PageLayout))))
    src = draw(pool_layout(base=SRC_BASE, heads=src_heads, **kw))
    dst = draw(pool_layout(base=DST_BASE, heads=dst_heads, **kw))
    sp, dp = draw(page_pairs(src.num_pages, dst.num_pages))
    return src, dst, sp, dp, soff, doff, nh


# --- properties -----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(whole_page_case())
def test_whole_pages_plan_moves_exactly_the_requested_bytes(case):
    src, dst, sp, dp = case
    plan = plan_pool(src, dst, np.array(sp, dtype=np.int64), np.array(dp, dtype=np.int64))
    got = execute(plan, src, dst)
    want = expected(src, dst, sp, dp)
    np.testing.assert_array_equal(got, want)
    assert plan.total_bytes == len(sp) * src.page_bytes * len(src.buffers)
    assert_no_dst_overlap(plan)
    assert_coalesced(plan)
    runs = page_runs(np.array(sp), np.array(dp))
    # never more than one descriptor per (buffer, run)
    assert plan.num_descriptors <= len(src.buffers) * runs.lengths.size


@settings(max_examples=200, deadline=None)
@given(head_slice_case())
def test_head_slice_plan_moves_exactly_the_slice(case):
    src, dst, sp, dp, soff, doff, nh = case
    plan = plan_pool(src, dst, sp, dp, src_head_offset=soff, dst_head_offset=doff, num_heads=nh)
    got = execute(plan, src, dst)
    want = expected(src, dst, sp, dp, soff, doff, nh)
    np.testing.assert_array_equal(got, want)
    assert plan.total_bytes == len(sp) * src.page_size * nh * src.head_dim * src.itemsize * len(src.buffers)
    assert_no_dst_overlap(plan)
    assert_coalesced(plan)
    if src.page_layout is PageLayout.HND:
        # head-major pages: a head slice never costs more than one descriptor per page and buffer
        assert plan.num_descriptors <= len(sp) * len(src.buffers)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_contiguous_pages_give_one_descriptor_per_buffer(data):
    num_layers = data.draw(st.integers(1, 4))
    page_size = data.draw(st.integers(1, 8))
    heads = data.draw(st.integers(1, 4))
    head_dim = data.draw(st.integers(1, 8))
    itemsize = data.draw(st.sampled_from([1, 2]))
    num_pages = data.draw(st.integers(1, 16))
    adjacent = data.draw(st.booleans())
    gaps = 0 if adjacent else data.draw(st.integers(1, 4096))
    kw = dict(num_layers=num_layers, page_size=page_size, num_kv_heads=heads, head_dim=head_dim,
              itemsize=itemsize, num_pages=num_pages)
    nbuf = num_layers * 2
    src = make_pool(base=SRC_BASE, gaps=gaps, memory_order=data.draw(st.permutations(range(nbuf))), **kw)
    dst = make_pool(base=DST_BASE, gaps=gaps, memory_order=data.draw(st.permutations(range(nbuf))), **kw)
    n = data.draw(st.integers(1, num_pages))
    a = data.draw(st.integers(0, num_pages - n))
    b = data.draw(st.integers(0, num_pages - n))
    plan = plan_pool(src, dst, np.arange(a, a + n), np.arange(b, b + n))
    np.testing.assert_array_equal(execute(plan, src, dst), expected(src, dst, range(a, a + n), range(b, b + n)))
    assert plan.num_descriptors <= nbuf
    if not adjacent:
        assert plan.num_descriptors == nbuf
    assert_coalesced(plan)


def test_whole_pool_of_adjacent_buffers_is_one_descriptor():
    src = make_pool(base=SRC_BASE, gaps=0, num_layers=3, num_pages=8)
    dst = make_pool(base=DST_BASE, gaps=0, num_layers=3, num_pages=8)
    plan = plan_pool(src, dst, np.arange(8), np.arange(8))
    assert plan.num_descriptors == 1
    assert int(plan.src_addrs[0]) == SRC_BASE and int(plan.dst_addrs[0]) == DST_BASE
    assert plan.total_bytes == 6 * 8 * src.page_bytes


def test_scattered_pages_one_descriptor_per_page_and_buffer():
    src = make_pool(base=SRC_BASE, num_layers=2, num_pages=10)
    dst = make_pool(base=DST_BASE, num_layers=2, num_pages=10)
    plan = plan_pool(src, dst, np.array([0, 2, 4]), np.array([9, 5, 1]))
    assert plan.num_descriptors == 3 * 4
    assert set(plan.lengths.tolist()) == {src.page_bytes}


def test_pairing_is_by_layer_and_component_not_position():
    kw = dict(num_layers=3, num_pages=4, page_size=2, num_kv_heads=2, head_dim=4, itemsize=2)
    src = make_pool(base=SRC_BASE, **kw)
    # destination: buffers tuple reversed and shuffled in memory too
    dst = make_pool(base=DST_BASE, tuple_order=[5, 4, 3, 2, 1, 0], memory_order=[3, 0, 5, 1, 4, 2], **kw)
    assert [(b.layer, b.component) for b in dst.buffers][0] == (2, Component.V)
    plan = plan_pool(src, dst, np.array([1]), np.array([3]))
    pb = src.page_bytes
    got = set(zip(plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.lengths.tolist()))
    want = {(src.buffer(layer, c).addr + 1 * pb, dst.buffer(layer, c).addr + 3 * pb, pb)
            for layer in range(3) for c in (Component.K, Component.V)}
    assert got == want


def test_head_slice_hetero_tp_example():
    # prefill rank holds heads 4..7 of 8 (4 local), decode tp 1 holds all 8:
    # prefill's 4 heads land at dst head offset 4, token by token.
    kw = dict(num_layers=1, num_pages=4, page_size=2, head_dim=8, itemsize=2)
    src = make_pool(base=SRC_BASE, num_kv_heads=4, total_kv_heads=8, **kw)
    dst = make_pool(base=DST_BASE, num_kv_heads=8, total_kv_heads=8, **kw)
    plan = plan_pool(src, dst, np.array([0, 1]), np.array([2, 3]), src_head_offset=0, dst_head_offset=4,
                     num_heads=4)
    hb = 8 * 2
    # 2 pages x 2 tokens x 2 buffers; source tokens are contiguous, destination strided
    assert plan.num_descriptors == 8
    assert set(plan.lengths.tolist()) == {4 * hb}
    k_dst = dst.buffer(0, Component.K).addr
    assert int(plan.dst_addrs[0]) == k_dst + 2 * dst.page_bytes + 4 * hb
    assert int(plan.dst_addrs[1]) == k_dst + 2 * dst.page_bytes + dst.token_bytes + 4 * hb
    np.testing.assert_array_equal(execute(plan, src, dst), expected(src, dst, [0, 1], [2, 3], 0, 4, 4))


# --- errors ---------------------------------------------------------------------


def test_plan_pool_rejects_out_of_range_pages():
    src = make_pool(base=SRC_BASE, num_pages=4)
    dst = make_pool(base=DST_BASE, num_pages=6)
    with pytest.raises(IndexError, match=r"target pool \(source\): page index 4 outside the pool of 4"):
        plan_pool(src, dst, np.array([0, 4]), np.array([0, 1]))
    with pytest.raises(IndexError, match=r"destination\): page index -1 outside the pool of 6"):
        plan_pool(src, dst, np.array([0, 1]), np.array([0, -1]))
    with pytest.raises(IndexError, match="page index 6"):
        plan_pool(src, dst, np.array([3]), np.array([6]))


def test_plan_pool_rejects_mismatched_shapes():
    src = make_pool(base=SRC_BASE, page_size=16)
    with pytest.raises(ValueError, match="page size"):
        plan_pool(src, make_pool(base=DST_BASE, page_size=32), [0], [0])
    with pytest.raises(ValueError):
        plan_pool(src, make_pool(base=DST_BASE, head_dim=64), [0], [0])
    with pytest.raises(ValueError):
        plan_pool(src, make_pool(base=DST_BASE, itemsize=4, dtype="float32"), [0], [0])
    with pytest.raises(ValueError, match="page lists differ"):
        plan_pool(src, make_pool(base=DST_BASE), [0, 1], [0])


def test_plan_pool_rejects_head_slice_outside_local_heads():
    src = make_pool(base=SRC_BASE, num_kv_heads=4)
    dst = make_pool(base=DST_BASE, num_kv_heads=2)
    with pytest.raises(ValueError, match="head slice"):
        plan_pool(src, dst, [0], [0], src_head_offset=3, num_heads=2)
    with pytest.raises(ValueError, match="head slice"):
        plan_pool(src, dst, [0], [0], dst_head_offset=1, num_heads=2)
    with pytest.raises(ValueError, match="head slice"):
        plan_pool(src, dst, [0], [0])  # all 4 source heads do not fit in 2


@pytest.mark.parametrize("kw", [dict(src_head_offset=-1, num_heads=1), dict(dst_head_offset=-1, num_heads=1),
                                dict(num_heads=0), dict(num_heads=-1)])
def test_plan_pool_rejects_negative_head_slices(kw):
    src = make_pool(base=SRC_BASE, num_kv_heads=2)
    dst = make_pool(base=DST_BASE, num_kv_heads=4)
    with pytest.raises(ValueError):
        plan_pool(src, dst, [0], [0], **kw)


def test_empty_page_lists_plan_nothing():
    plan = plan_pool(make_pool(base=SRC_BASE), make_pool(base=DST_BASE), np.zeros(0, np.int64),
                     np.zeros(0, np.int64))
    assert plan.num_descriptors == 0 and plan.total_bytes == 0


# --- page_runs / check_pages ------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 40), st.integers(-3, 40)), max_size=30))
def test_page_runs_partition_and_are_maximal(pairs):
    src = np.array([p[0] for p in pairs], dtype=np.int64)
    dst = np.array([p[1] for p in pairs], dtype=np.int64)
    runs = page_runs(src, dst)
    assert isinstance(runs, PageRuns)
    assert (runs.lengths >= 1).all()
    assert int(runs.lengths.sum()) == len(pairs)
    rebuilt_src = [s + i for s, n in zip(runs.src_starts.tolist(), runs.lengths.tolist()) for i in range(n)]
    rebuilt_dst = [d + i for d, n in zip(runs.dst_starts.tolist(), runs.lengths.tolist()) for i in range(n)]
    assert rebuilt_src == src.tolist() and rebuilt_dst == dst.tolist()
    for i in range(runs.lengths.size - 1):
        end_s = runs.src_starts[i] + runs.lengths[i]
        end_d = runs.dst_starts[i] + runs.lengths[i]
        assert not (end_s == runs.src_starts[i + 1] and end_d == runs.dst_starts[i + 1])


def test_page_runs_examples():
    runs = page_runs(np.array([3, 4, 5, 9, 10, 11]), np.array([0, 1, 2, 3, 7, 8]))
    assert runs.src_starts.tolist() == [3, 9, 10]
    assert runs.dst_starts.tolist() == [0, 3, 7]
    assert runs.lengths.tolist() == [3, 1, 2]
    empty = page_runs(np.array([]), np.array([]))
    assert empty.lengths.size == 0 and empty.src_starts.size == 0
    with pytest.raises(ValueError):
        page_runs(np.array([1, 2]), np.array([1]))
    with pytest.raises(ValueError):
        page_runs(np.zeros((2, 2)), np.zeros((2, 2)))


def test_check_pages():
    check_pages(np.array([0, 5, 9]), 10, "here")
    check_pages(np.zeros(0, dtype=np.int64), 0, "here")
    with pytest.raises(IndexError, match="somewhere: page index 10 outside the pool of 10 pages"):
        check_pages(np.array([0, 10, 3]), 10, "somewhere")
    with pytest.raises(IndexError, match="page index -2"):
        check_pages(np.array([1, -2, 12]), 10, "x")


# --- plan_aux / TransferPlan ------------------------------------------------------


def test_plan_aux():
    src = make_aux(addr=0x1000, slot_bytes=64, num_slots=8)
    dst = make_aux(addr=0x9000, slot_bytes=64, num_slots=4)
    plan = plan_aux(src, dst, 7, 3)
    assert plan.src_addrs.tolist() == [0x1000 + 7 * 64]
    assert plan.dst_addrs.tolist() == [0x9000 + 3 * 64]
    assert plan.lengths.tolist() == [64]
    assert plan.src_addrs.dtype == np.uint64
    with pytest.raises(ValueError, match="64 vs 32"):
        plan_aux(src, AuxDescriptor(addr=0x9000, slot_bytes=32, num_slots=4), 0, 0)
    with pytest.raises(IndexError, match="aux index 8"):
        plan_aux(src, dst, 8, 0)
    with pytest.raises(IndexError, match="aux index -1"):
        plan_aux(src, dst, -1, 0)
    with pytest.raises(IndexError, match="aux index 4 outside the destination"):
        plan_aux(src, dst, 0, 4)


def _plan(*rows):
    return TransferPlan(*(np.array(c, dtype=np.uint64) for c in zip(*rows)) if rows else
                        (np.zeros(0, np.uint64),) * 3)


def test_transfer_plan_empty_and_concat():
    e = TransferPlan.empty()
    assert e.num_descriptors == 0 and e.total_bytes == 0
    assert all(a.dtype == np.uint64 for a in (e.src_addrs, e.dst_addrs, e.lengths))
    assert TransferPlan.concat([]).num_descriptors == 0
    assert TransferPlan.concat([e, e]).num_descriptors == 0
    a = _plan((10, 100, 5), (20, 200, 6))
    b = _plan((30, 300, 7))
    c = TransferPlan.concat([a, e, b])
    assert c.src_addrs.tolist() == [10, 20, 30]
    assert c.dst_addrs.tolist() == [100, 200, 300]
    assert c.lengths.tolist() == [5, 6, 7]
    assert c.total_bytes == 18 and c.num_descriptors == 3
    assert c.src_addrs.dtype == np.uint64
    # concat does not merge: coalesce is separate
    assert TransferPlan.concat([_plan((0, 0, 4)), _plan((4, 4, 4))]).num_descriptors == 2


def test_coalesce():
    p = _plan((0, 100, 4), (4, 104, 4), (8, 108, 2), (20, 110, 1), (21, 200, 1))
    c = coalesce(p)
    assert list(zip(c.src_addrs.tolist(), c.dst_addrs.tolist(), c.lengths.tolist())) == [
        (0, 100, 10), (20, 110, 1), (21, 200, 1)]
    single = _plan((0, 0, 3))
    assert coalesce(single) is single


def test_split_entries_cuts_long_entries_and_keeps_every_byte():
    from transfer.plan import split_entries
    plan = TransferPlan(np.array([1000, 50_000], dtype=np.uint64), np.array([9000, 90_000], dtype=np.uint64),
                        np.array([10_000, 3], dtype=np.uint64))
    out = split_entries(plan, 4096)
    assert out.lengths.tolist() == [4096, 4096, 1808, 3]
    assert out.src_addrs.tolist() == [1000, 5096, 9192, 50_000]
    assert out.dst_addrs.tolist() == [9000, 13096, 17192, 90_000]
    assert split_entries(plan, 1 << 20) is plan


@settings(max_examples=150, deadline=None)
@given(head_slice_case())
def test_source_entries_are_counted_as_they_are_built(case):
    """The staged path decides direct or gathered by the count of source
    descriptors, counted without building them: the count is the built length."""
    from transfer.plan import page_slice
    from transfer.rooms.parts import num_source_entries, page_entries

    src, _, sp, _, soff, _, nh = case
    pages = np.array(sp, dtype=np.int64)
    for pools in (((src, page_slice(src, soff, nh)),), ((src, page_slice(src, 0, src.num_kv_heads)),)):
        built = page_entries(pages, pools, lambda pool: None)[1].size if pages.size else 0
        assert num_source_entries(pages, pools) == built


@settings(max_examples=100, deadline=None)
@given(head_slice_case(), st.randoms(use_true_random=False))
def test_a_parts_layer_groups_write_exactly_the_whole_parts_descriptors(case, rnd):
    """Layer-wise sends through staging: in a region granted for the room, a
    part's layer groups (any partition of the layers of a target and a draft
    pool, any order) together write every (source, destination, bytes)
    descriptor the whole part writes, each once, and their byte ranges tile
    the part; in a region of its own, a group's share reads the same and
    packs it from the region's start."""
    import dataclasses

    from bootstrap.messages import PoolRole
    from transfer.plan import page_slice, staged_bytes
    from transfer.rooms.parts import LayerShare, PagePart, source_plan

    src, _, sp, _, soff, _, nh = case
    pages = np.array(sp, dtype=np.int64)
    draft = dataclasses.replace(src, role=PoolRole.DRAFT)
    pools = tuple((p, page_slice(p, soff, nh)) for p in (src, draft))
    nbytes = sum(staged_bytes(p, sl, pages.size) for p, sl in pools)
    whole = PagePart(None, 0, pages, 0, pools, nbytes, direct=True, granted=0)  # in a region granted for the room
    layers = [(role, layer) for role, n in ((PoolRole.TARGET, src.num_layers), (PoolRole.DRAFT, draft.num_layers))
              for layer in range(n)]
    rnd.shuffle(layers)
    cuts = sorted(rnd.sample(range(1, len(layers)), min(len(layers) - 1, rnd.randint(0, 3))))
    groups = [layers[a:b] for a, b in zip([0, *cuts], [*cuts, len(layers)])]
    base = 1 << 40
    expect = source_plan(whole, base)
    want = sorted(zip(expect.src_addrs.tolist(), expect.dst_addrs.tolist(), expect.lengths.tolist()))
    got, covered = [], []
    for group in groups:
        spec = LayerShare(whole, 1, {role: tuple(sorted(l for r, l in group if r is role))
                                     for role in (PoolRole.TARGET, PoolRole.DRAFT)})
        plan = source_plan(spec, base)
        got += zip(plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.lengths.tolist())
        assert spec.in_place and spec.write_bytes == int(plan.lengths.sum())
        covered += spec.ranges()
        own = source_plan(LayerShare(dataclasses.replace(whole, granted=None), 1, spec.layers), base)  # packed
        assert np.array_equal(own.src_addrs, plan.src_addrs) and np.array_equal(own.lengths, plan.lengths)
        assert own.dst_addrs.tolist() == (base + np.concatenate(([0], np.cumsum(own.lengths)[:-1]))).tolist()
    assert sorted(got) == want
    covered.sort()
    assert covered[0][0] == 0 and sum(n for _, n in covered) == nbytes
    assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))  # no overlap, no gap
