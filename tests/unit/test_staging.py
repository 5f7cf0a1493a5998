"""Staging's allocator and its torch gather/scatter, on CPU tensors (no engine)."""

import random

import pytest
import torch

from transfer.plan import page_slice
from transfer.pools import MHAPool, MLAPool, describe_pool, pool_tensors
from transfer.plan import staged_bytes
from transfer.staging.area import StagingArea
from transfer.staging.copies import gather, scatter


def test_staging_area_first_fit_free_and_merge():
    area = StagingArea(64 << 10)
    a = area.alloc(10_000)  # rounds up to 12 KiB
    b = area.alloc(4096)
    assert (a, b) == (0, 12288)
    assert area.alloc(60 << 10) is None
    area.free(a, 10_000)
    assert area.alloc(8192) == 0  # first fit reuses the hole
    area.free(0, 8192)
    area.free(b, 4096)
    assert area.free_bytes == 64 << 10
    assert area.alloc(64 << 10) == 0  # holes merged back into one region


def _mha(pages, heads, layout, seed, itemsize_dtype=torch.bfloat16, layers=2, page_size=4, head_dim=6):
    g = torch.Generator().manual_seed(seed)
    shape = (pages, page_size, heads, head_dim) if layout == "nhd" else (pages, heads, page_size, head_dim)

    def rand():
        return torch.randint(-30000, 30000, shape, dtype=torch.int16, generator=g).view(itemsize_dtype)
    return MHAPool(k=[rand() for _ in range(layers)], v=[rand() for _ in range(layers)], total_kv_heads=8,
                   layout=layout)


def _nhd(t, layout):
    """Any MHA tensor as [pages, page_size, heads, head_dim]."""
    return t if layout == "nhd" else t.permute(0, 2, 1, 3)


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("src_heads,dst_heads,soff,doff,n", [(4, 4, 0, 0, 4), (4, 8, 0, 4, 4), (8, 2, 6, 0, 2),
                                                             (2, 2, 1, 1, 1), (8, 4, 3, 1, 3)])
def test_gather_then_scatter_moves_exactly_the_head_slice(layout, src_heads, dst_heads, soff, doff, n):
    src_pool, dst_pool = _mha(10, src_heads, layout, 1), _mha(12, dst_heads, layout, 2)
    src_d, dst_d = describe_pool(src_pool), describe_pool(dst_pool)
    src_t, dst_t = pool_tensors([src_pool]), pool_tensors([dst_pool])
    before = {k: v.clone() for k, v in dst_t.items()}
    src_pages = random.Random(3).sample(range(10), 5)
    dst_pages = random.Random(4).sample(range(12), 5)
    sl_src, sl_dst = page_slice(src_d, soff, n), page_slice(dst_d, doff, n)
    assert sl_src.packed_bytes == sl_dst.packed_bytes
    staging = torch.zeros(staged_bytes(src_d, sl_src, 5) + 64, dtype=torch.uint8)
    written = gather(staging, 0, src_t, src_d, sl_src, torch.tensor(src_pages))
    assert written == staged_bytes(src_d, sl_src, 5)
    assert scatter(staging, 0, dst_t, dst_d, sl_dst, torch.tensor(dst_pages)) == written
    for key, got in dst_t.items():
        want = before[key].clone()
        _nhd(want, layout)[dst_pages, :, doff:doff + n] = _nhd(src_t[key], layout)[src_pages, :, soff:soff + n]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), key


def test_gather_scatter_mla_whole_pages_at_an_odd_offset():
    g = torch.Generator().manual_seed(7)
    mk = lambda p: MLAPool(latent=[torch.randint(0, 255, (p, 4, 10), dtype=torch.uint8, generator=g)  # noqa: E731
                                   for _ in range(3)])
    src_pool, dst_pool = mk(6), mk(6)
    src_d, dst_d = describe_pool(src_pool), describe_pool(dst_pool)
    src_t, dst_t = pool_tensors([src_pool]), pool_tensors([dst_pool])
    staging = torch.zeros(4096, dtype=torch.uint8)
    sl = page_slice(src_d, 0, 1)
    gather(staging, 3, src_t, src_d, sl, torch.tensor([5, 0]))  # byte offset 3: only 1-byte words fit
    scatter(staging, 3, dst_t, dst_d, sl, torch.tensor([1, 2]))
    for key in src_t:
        assert torch.equal(dst_t[key][[1, 2]], src_t[key][[5, 0]])


@pytest.mark.parametrize("fused", [False, True], ids=["buffers-apart", "one-tensor"])
def test_a_layer_groups_buffers_packed_or_in_place_reach_only_those_layers(fused):
    """Layer-wise shares: gather packs only the group's layers' buffers one
    after the other; scatter unpacks such a share, or takes the group's
    layers from their places in a whole part's packing (``in_place``); the
    other layers' pages stay as they were."""
    layers, pages_n = 5, 8
    g = torch.Generator().manual_seed(11)
    if fused:  # every buffer in one allocation, a fixed stride apart (one index op per run of layers)
        whole = torch.randint(0, 255, (layers, 2, pages_n, 4, 2, 12), dtype=torch.uint8, generator=g)
        src_pool = MHAPool(k=list(whole[:, 0]), v=list(whole[:, 1]), total_kv_heads=2)
    else:
        src_pool = _mha(pages_n, 2, "nhd", 11, torch.uint8, layers=layers)
    dst_pool = _mha(pages_n, 2, "nhd", 12, torch.uint8, layers=layers)
    src_d, dst_d = describe_pool(src_pool), describe_pool(dst_pool)
    src_t, dst_t = pool_tensors([src_pool]), pool_tensors([dst_pool])
    before = {k: v.clone() for k, v in dst_t.items()}
    sl = page_slice(src_d, 0, 2)
    src_pages, dst_pages = torch.tensor([3, 0, 6]), torch.tensor([1, 7, 2])
    group = (1, 2, 4)  # two runs of layers
    share = len(group) * 2 * 3 * sl.packed_bytes
    packed = torch.zeros(share, dtype=torch.uint8)
    assert gather(packed, 0, src_t, src_d, sl, src_pages, layers=group) == share
    assert scatter(packed, 0, dst_t, dst_d, sl, dst_pages, layers=group) == share
    part = torch.zeros(staged_bytes(src_d, sl, 3), dtype=torch.uint8)
    gather(part, 0, src_t, src_d, sl, src_pages)
    in_place = {k: v.clone() for k, v in before.items()}
    assert scatter(part, 0, in_place, dst_d, sl, dst_pages, layers=group, in_place=True) == part.numel()
    for got in (dst_t, in_place):
        for (role, layer, comp), t in got.items():
            want = before[(role, layer, comp)].clone()
            if layer in group:
                want[dst_pages] = src_t[(role, layer, comp)][src_pages]
            assert torch.equal(t, want), (layer, comp)
