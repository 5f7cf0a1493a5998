"""A pool's pages as storage segments, and pool fingerprints (CPU tensors, no store)."""

import ctypes

import pytest
import torch

from bootstrap.messages import PoolRole
from transfer.pools import MHAPool, MLAPool
from transfer.storage.keys import page_keys
from transfer.storage.segments import page_bytes, page_segments, pages_segments, pool_fingerprint, pool_regions


def mha(layout="nhd", pages=6, layers=3, heads=2, page_size=4, head_dim=8, dtype=torch.bfloat16, role="target"):
    shape = (pages, page_size, heads, head_dim) if layout == "nhd" else (pages, heads, page_size, head_dim)
    return MHAPool(k=[torch.randn(shape).to(dtype) for _ in range(layers)],
                   v=[torch.randn(shape).to(dtype) for _ in range(layers)], layout=layout, role=PoolRole(role))


def mla(pages=6, layers=2, page_size=4, latent=24, four_d=False):
    shape = (pages, page_size, 1, latent) if four_d else (pages, page_size, latent)
    return MLAPool(latent=[torch.randn(shape) for _ in range(layers)])


def read(segments) -> bytes:
    return b"".join(ctypes.string_at(addr, n) for addr, n in segments)


@pytest.mark.parametrize("pool", [mha(), mha("hnd"), mla(), mla(four_d=True)], ids=["nhd", "hnd", "mla", "mla-4d"])
def test_a_page_is_one_block_per_layer_and_component_in_order(pool):
    tensors = ([t for pair in zip(pool.k, pool.v) for t in pair] if isinstance(pool, MHAPool) else pool.latent)
    for page in (0, 3, 5):
        segs = page_segments(pool, page)
        assert [addr for addr, _ in segs] == [t[page].data_ptr() for t in tensors]
        assert read(segs) == b"".join(t[page].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
    assert page_bytes(pool) == sum(n for _, n in page_segments(pool, 0))
    assert pages_segments(pool, [5, 0]) == [page_segments(pool, 5), page_segments(pool, 0)]
    assert pool_regions(pool) == [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]


def test_bad_pools_and_pages_are_refused():
    pool = mha()
    with pytest.raises(ValueError, match="page 6 not in"):
        page_segments(pool, 6)
    with pytest.raises(ValueError, match="page -1"):
        page_segments(pool, -1)
    strided = MHAPool(k=[torch.randn(6, 8, 2, 8)[:, ::2]], v=[torch.randn(6, 4, 2, 8)])
    with pytest.raises(ValueError, match="contiguous"):
        page_segments(strided, 0)
    mismatched = MHAPool(k=[torch.randn(6, 4, 2, 8)], v=[torch.randn(6, 4, 2, 4)])
    with pytest.raises(ValueError, match="differs"):
        page_segments(mismatched, 0)
    with pytest.raises(ValueError, match="as many K as V"):
        page_segments(MHAPool(k=[torch.randn(6, 4, 2, 8)], v=[]), 0)


def test_fingerprints_describe_the_pool():
    fp = pool_fingerprint(mha("hnd", heads=2, head_dim=8), model="m", tp_rank=1, tp_size=4)
    assert (fp.role, fp.attention, fp.page_layout, fp.dtype, fp.page_size, fp.num_layers, fp.num_kv_heads,
            fp.head_dim, fp.tp_rank, fp.tp_size) == ("target", "mha", "hnd", "bfloat16", 4, 3, 2, 8, 1, 4)
    latent = pool_fingerprint(mla(latent=24), model="m", tp_rank=3, tp_size=4)
    assert (latent.attention, latent.num_kv_heads, latent.head_dim, latent.tp_rank, latent.tp_size, latent.dtype) \
        == ("mla", 1, 24, 0, 1, "float32")
    assert pool_fingerprint(mla(latent=24, four_d=True), model="m") == latent


def test_target_and_draft_pools_and_tp_ranks_get_disjoint_keys_and_mla_is_shared():
    tokens = list(range(40))
    target = page_keys(pool_fingerprint(mha(), model="m"), tokens)
    draft = page_keys(pool_fingerprint(mha(role="draft"), model="m"), tokens)
    rank1 = page_keys(pool_fingerprint(mha(), model="m", tp_rank=1, tp_size=2), tokens)
    assert len(target) == 10 and not set(target) & set(draft) and not set(target) & set(rank1)
    assert page_keys(pool_fingerprint(mla(), model="m", tp_rank=0, tp_size=2), tokens) == \
        page_keys(pool_fingerprint(mla(), model="m", tp_rank=1, tp_size=2), tokens)
