"""SGLang's KVArgs -> kvferry pools and aux rows (transfer.adapters.sglang.kvargs needs no SGLang)."""

from types import SimpleNamespace

import pytest
import torch

from bootstrap.messages import PoolRole
from transfer.adapters.sglang.kvargs import (UnsupportedSetup, aux_regions_from_kv_args, check_supported,
                                             pools_from_kv_args, states_from_kv_args, torch_dtype_name)
from transfer.pools import aux_tensors, describe_pool
from transfer.state_pools import describe_state


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
    (dict(state_types=["dsa_tail"], state_data_ptrs=[[1]]), {}, "state pools of type dsa_tail"),
    (dict(state_types=["minimax_index_k", "swa"], state_data_ptrs=[[1], [2]]), {}, "of type minimax_index_k (kvferry"),
    (dict(state_types=["swa_ring"], state_data_ptrs=[[1]]), {}, "swa_ring: DeepSeek-V4 state"),
    (dict(mla_compression_ratios=[0, 4, 128]), {}, "DeepSeek-V4's compressed KV pools"),
    (dict(state_types=["swa"]), {}, "state buffers that do not match the state types (swa)"),
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


def test_aux_regions_are_sglang_regions_without_a_copy():
    regions = [torch.randint(0, 256, (6, n), dtype=torch.uint8) for n in (64, 512, 8)]
    args = SimpleNamespace(aux_data_ptrs=[r.data_ptr() for r in regions], aux_data_lens=[r.nbytes for r in regions],
                           aux_item_lens=[r.shape[1] for r in regions])
    raw = aux_regions_from_kv_args(args)
    assert [(a.addr, a.row_bytes, a.num_rows) for a in raw] == [(r.data_ptr(), r.shape[1], 6) for r in regions]
    views = aux_tensors(raw)  # what KVManager registers and sends from
    assert all(torch.equal(v, r) for v, r in zip(views, regions))
    views[1][4] = torch.arange(512, dtype=torch.int64).to(torch.uint8)  # the same memory: no copy
    assert torch.equal(regions[1][4], views[1][4])
    assert aux_regions_from_kv_args(SimpleNamespace(aux_data_ptrs=[])) == []
    with pytest.raises(UnsupportedSetup, match="slot counts"):
        aux_regions_from_kv_args(SimpleNamespace(aux_data_ptrs=[1, 2], aux_data_lens=[64, 64], aux_item_lens=[8, 16]))

@pytest.mark.parametrize("is_mla, sharding", [(False, ["sharded", "replicated", "sharded"]),
                                              (True, ["replicated", "replicated", "sharded"])])
def test_state_types_become_state_pools_over_sglangs_memory(is_mla, sharding):
    """Each SGLang state component is one state pool over its memory (no
    copy): an MLA model's states are the same on every TP rank (one prefill
    rank sends them), DSA's indexer always is, Mamba's heads never are;
    page-indexed states pair the shorter index list, slot-indexed ones match."""
    bufs = [[torch.randint(0, 256, (9, n), dtype=torch.uint8) for n in sizes] for sizes in ((128, 128), (64,), (48, 96))]
    args = SimpleNamespace(state_types=["swa", "dsa", "mamba"],
                           state_data_ptrs=[[t.data_ptr() for t in b] for b in bufs],
                           state_data_lens=[[t.nbytes + 5 for t in b] for b in bufs],  # a tail shorter than an item
                           state_item_lens=[[t.shape[1] for t in b] for b in bufs])
    pools = states_from_kv_args(args, is_mla=is_mla)
    descs = [describe_state(p) for p in pools]
    assert [d.sharding.value for d in descs] == sharding
    assert [d.exact for d in descs] == [False, False, True]
    assert [[(b.addr, b.item_bytes, b.num_items) for b in d.buffers] for d in descs] == \
        [[(t.data_ptr(), t.shape[1], 9) for t in b] for b in bufs]
    pools[2].buffers[1][4] = 7  # the same memory
    assert bool((bufs[2][1][4] == 7).all())
