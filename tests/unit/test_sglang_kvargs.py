"""SGLang's KVArgs -> kvferry pools and aux rows (transfer.adapters.sglang.kvargs needs no SGLang)."""

from types import SimpleNamespace

import pytest
import torch

from bootstrap.messages import PoolRole
from transfer.adapters.sglang.kvargs import (AuxRows, UnsupportedSetup, check_supported, pools_from_kv_args,
                                             torch_dtype_name)
from transfer.pools import describe_pool


def _kv_args(target, draft=(), **kw):
    bufs = list(target) + list(draft)
    return SimpleNamespace(kv_data_ptrs=[b.data_ptr() for b in bufs], kv_data_lens=[b.nbytes for b in bufs],
                           kv_item_lens=[b[0].nbytes * 4 for b in bufs],  # 4 tokens per page
                           num_draft_entries=len(draft), page_size=4, kv_cache_dtype_str="bfloat16", **kw)


def test_mha_target_and_draft_from_kv_args():
    # SGLang's MHA buffers are [tokens, heads, head_dim]: 2 layers K then V; a 1-layer draft with 1 head
    target = [torch.zeros(32, 2, 8, dtype=torch.bfloat16) for _ in range(4)]
    draft = [torch.zeros(32, 1, 8, dtype=torch.bfloat16) for _ in range(2)]
    pools = pools_from_kv_args(_kv_args(target, draft, kv_head_num=2, total_kv_head_num=4), is_mla=False)
    t, d = (describe_pool(p) for p in pools)
    assert (t.num_layers, t.num_kv_heads, t.total_kv_heads, t.head_dim, t.num_pages, t.dtype) == \
        (2, 2, 4, 8, 8, "bfloat16")
    assert [b.addr for b in t.buffers] == [b.data_ptr() for b in target]
    assert (d.role, d.num_layers, d.num_kv_heads, d.total_kv_heads, d.head_dim) == (PoolRole.DRAFT, 1, 1, 2, 8)


def test_mla_from_kv_args_and_unknown_dtype_falls_back_to_bytes():
    latent = [torch.zeros(32, 1, 24, dtype=torch.bfloat16) for _ in range(3)]
    (pool,) = pools_from_kv_args(_kv_args(latent), is_mla=True)
    assert (describe_pool(pool).head_dim, describe_pool(pool).attention.value) == (24, "mla")
    assert torch_dtype_name(SimpleNamespace(kv_cache_dtype_str="fp8_e4m3")) == "float8_e4m3fn"
    assert torch_dtype_name(SimpleNamespace(kv_cache_dtype_str="auto")) == "uint8"
    auto = SimpleNamespace(**{**vars(_kv_args(latent)), "kv_cache_dtype_str": "auto"})
    (raw,) = pools_from_kv_args(auto, is_mla=True)
    assert describe_pool(raw).head_dim == 48  # bytes


def test_a_draft_whose_item_size_is_no_whole_head_count_is_refused():
    target = [torch.zeros(32, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    draft = [torch.zeros(32, 1, 12, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(UnsupportedSetup, match="draft item size"):
        pools_from_kv_args(_kv_args(target, draft, kv_head_num=2, total_kv_head_num=2), is_mla=False)


@pytest.mark.parametrize("args, server, words", [
    (dict(state_types=["swa"]), {}, "state pools (swa"),
    (dict(is_hybrid_mla_backend=True), {}, "hybrid MLA"),
    ({}, dict(pp_size=4), "pipeline parallelism (--pp-size 4)"),
    ({}, dict(dcp_size=2), "context parallelism (dcp_size 2)"),
    (dict(kv_layout="vectorized_5d"), {}, "KV layout 'vectorized_5d'"),
])
def test_unsupported_setups_are_named(args, server, words):
    with pytest.raises(UnsupportedSetup, match="unsupported SGLang set-up") as info:
        check_supported(SimpleNamespace(**args), SimpleNamespace(**server))
    assert words in str(info.value)
    check_supported(SimpleNamespace(state_types=[], kv_layout=None), SimpleNamespace(pp_size=1))


def test_aux_rows_pack_and_unpack_every_region_of_one_slot():
    regions = [torch.randint(0, 256, (6, n), dtype=torch.uint8) for n in (64, 512, 8)]
    args = SimpleNamespace(aux_data_ptrs=[r.data_ptr() for r in regions], aux_data_lens=[r.nbytes for r in regions],
                           aux_item_lens=[r.shape[1] for r in regions])
    src = AuxRows.from_kv_args(args)
    src.pack(4)
    assert torch.equal(src.packed[4], torch.cat([r[4] for r in regions]))
    assert not src.packed[3].any()  # other slots untouched
    before = [r.clone() for r in regions]
    src.packed[2] = torch.arange(584, dtype=torch.int64).to(torch.uint8)
    src.unpack(2)
    assert torch.equal(torch.cat([r[2] for r in regions]), src.packed[2])
    assert all(torch.equal(r[i], b[i]) for r, b in zip(regions, before) for i in (0, 1, 3, 4, 5))
    assert AuxRows.from_kv_args(SimpleNamespace(aux_data_ptrs=[])) is None
    with pytest.raises(UnsupportedSetup, match="slot counts"):
        AuxRows.from_kv_args(SimpleNamespace(aux_data_ptrs=[1, 2], aux_data_lens=[64, 64], aux_item_lens=[8, 16]))
