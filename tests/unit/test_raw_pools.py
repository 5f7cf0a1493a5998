"""Pools described by raw pointers (SGLang's KVArgs) and multi-region aux plans."""

import numpy as np
import pytest
import torch

from bootstrap.messages import AuxDescriptor, PoolRole
from transfer.plan import plan_aux_regions
from transfer.pools import RawPool, describe_pool, head_dim_of, pool_from_pointers, pool_tensors, wrap_pointer


def _raw(bufs, **kw):
    return RawPool(addrs=[b.data_ptr() for b in bufs], nbytes=[b.nbytes for b in bufs],
                   page_bytes=[b[0].nbytes for b in bufs], **kw)


def test_mha_pool_from_pointers_views_the_memory_without_copying():
    gen = torch.Generator().manual_seed(1)
    bufs = [torch.randn(7, 4, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(6)]  # 3 layers K, V
    pool = pool_from_pointers(_raw(bufs, attention="mha", page_size=4, dtype="bfloat16", num_kv_heads=2,
                                   total_kv_heads=4))
    desc = describe_pool(pool)
    assert (desc.num_layers, desc.num_pages, desc.head_dim, desc.num_kv_heads, desc.total_kv_heads) == (3, 7, 8, 2, 4)
    assert [b.addr for b in desc.buffers] == [b.data_ptr() for b in bufs]  # K_0..K_2 then V_0..V_2
    assert torch.equal(pool.v[2], bufs[5])
    pool.k[1][5].fill_(3)  # a write through the view lands in the engine's memory
    assert bool((bufs[1][5] == 3).all())
    # the staged path's gather/scatter reads these same tensors
    assert pool_tensors([pool])[(PoolRole.TARGET, 0, desc.buffers[3].component)].data_ptr() == bufs[3].data_ptr()


def test_mla_and_draft_pools_from_pointers():
    bufs = [torch.zeros(5, 2, 24, dtype=torch.float16) for _ in range(2)]
    pool = pool_from_pointers(_raw(bufs, attention="mla", page_size=2, dtype="float16", role=PoolRole.DRAFT))
    desc = describe_pool(pool)
    assert (desc.attention.value, desc.head_dim, desc.num_layers, desc.role) == ("mla", 24, 2, PoolRole.DRAFT)


def test_a_buffer_longer_than_whole_pages_keeps_only_whole_pages():
    buf = torch.zeros(100, dtype=torch.uint8)
    raw = RawPool(attention="mla", addrs=[buf.data_ptr()], nbytes=[100], page_bytes=[32], page_size=2,
                  dtype="uint8")
    assert describe_pool(pool_from_pointers(raw)).num_pages == 3


@pytest.mark.parametrize("kw, match", [
    (dict(attention="gqa"), "attention"),
    (dict(addrs=[1, 2, 3], nbytes=[64] * 3, page_bytes=[16] * 3), "as many K as V"),
    (dict(page_bytes=[16, 32]), "same page_bytes"),
    (dict(addrs=[0, 8]), "non-null"),
    (dict(nbytes=[8, 8]), "holds no page"),
])
def test_raw_pool_rejects_inconsistent_buffers(kw, match):
    base = dict(attention="mha", addrs=[4096, 8192], nbytes=[64, 64], page_bytes=[16, 16], page_size=2,
                dtype="uint8")
    with pytest.raises(ValueError, match=match):
        RawPool(**{**base, **kw})


def test_head_dim_must_divide_the_page():
    assert head_dim_of(4 * 2 * 8 * 2, 4, 2, 2) == 8
    with pytest.raises(ValueError, match="not 4 tokens x 3 heads"):
        head_dim_of(4 * 2 * 8 * 2, 4, 3, 2)


def test_wrap_pointer_rejects_unknown_dtype_and_device():
    buf = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dtype"):
        wrap_pointer(buf.data_ptr(), 8, "bfloat17")
    with pytest.raises(ValueError, match="device"):
        wrap_pointer(buf.data_ptr(), 8, "uint8", "tpu")


def test_plan_aux_regions_moves_one_row_of_every_region():
    src = [AuxDescriptor(addr=1000, slot_bytes=64, num_slots=4), AuxDescriptor(addr=5000, slot_bytes=8, num_slots=4)]
    dst = [AuxDescriptor(addr=9000, slot_bytes=64, num_slots=2), AuxDescriptor(addr=20000, slot_bytes=8, num_slots=2)]
    plan = plan_aux_regions(src, dst, 3, 1)
    assert plan.src_addrs.tolist() == [1000 + 3 * 64, 5000 + 3 * 8]
    assert plan.dst_addrs.tolist() == [9000 + 64, 20000 + 8]
    assert plan.lengths.tolist() == [64, 8]
    with pytest.raises(ValueError, match="in number"):
        plan_aux_regions(src, dst[:1], 0, 0)
    with pytest.raises(IndexError, match="aux region 1"):
        plan_aux_regions(src, [dst[0], AuxDescriptor(addr=20000, slot_bytes=8, num_slots=1)], 0, 1)
    assert np.asarray(plan.lengths).dtype == np.uint64
