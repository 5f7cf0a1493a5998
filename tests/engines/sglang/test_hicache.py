"""kvferry's store as SGLang's HiCache L3 backend (transfer.adapters.sglang.hicache),
against SGLang 0.5.23's own parts on this CPU: its storage backend factory
(``--hicache-storage-backend dynamic``), its host KV pools (MHA ``page_first``
and ``layer_first``, MLA, a draft pool; built with ``pin_memory=False``, the
one thing a CPU needs: SGLang pins host pools through CUDA), its page hashes
(``get_hash_str``), and a real file store. Bytes compared exactly, random data
and page indices."""

from __future__ import annotations

import numpy as np
import pytest
import torch


PAGE = 4  # tokens per page
LAYERS = 3


def _config(tmp_path, *, tp_rank=0, tp_size=1, mla=False, url=None):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    extra = {"backend_name": "kvferry", "module_path": "transfer.adapters.sglang.hicache",
             "class_name": "KvferryHiCache", "interface_v1": 1,
             "kvferry_storage_url": url or f"file://{tmp_path / 'l3'}"}
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name="org/tiny-llama", extra_config=extra)


def _host_pool(layout="page_first", *, mla=False, heads=2, layers=LAYERS):
    """SGLang's host pool over a device pool on the CPU, unpinned."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    common = dict(size=64 * PAGE - PAGE, page_size=PAGE, dtype=torch.bfloat16, device="cpu", enable_memory_saver=False)
    span = dict(device_capacity_tokens=common["size"], start_layer=0, end_layer=layers)
    if mla:
        dev = MLATokenToKVPool(kv_lora_rank=32, qk_rope_head_dim=16, layer_num=layers, **common)
        return MLATokenToKVPoolHost(dev._mla_buffer_info(), 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                    target_layer_num=layers, **span)
    dev = MHATokenToKVPool(head_num=heads, head_dim=16, layer_num=layers, **common)
    return MHATokenToKVPoolHost(dev._mha_buffer_info(), 2.0, 0, PAGE, layout, pin_memory=False, device="cpu", **span)


def _backend(tmp_path, host, **kw):
    """Built as SGLang builds a dynamic backend, the host pool registered."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", _config(tmp_path, **kw), host)
    backend.register_mem_pool_host(host)
    return backend


def _keys(rng, num_pages: int) -> list[str]:
    """SGLang's own page hashes of a random prompt."""
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = rng.integers(0, 32000, num_pages * PAGE).tolist()
    keys, prior = [], None
    for i in range(num_pages):
        prior = get_hash_str(tokens[i * PAGE:(i + 1) * PAGE], prior)
        keys.append(prior)
    return keys


def _pages(host, rng, num_pages: int) -> torch.Tensor:
    """Host indices of ``num_pages`` random pages (not in order), filled with random bytes."""
    free = rng.permutation(host.size // PAGE)[:num_pages]
    idx = torch.from_numpy(np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in free]))
    for p in free:
        page = host.get_data_page(int(p) * PAGE, flat=True)
        noise = rng.integers(0, 256, page.numel() * page.element_size(), dtype=np.uint8)
        host.set_from_flat_data_page(int(p) * PAGE, torch.from_numpy(noise).view(page.dtype))
    return idx


def _bytes(host, idx: torch.Tensor) -> list[bytes]:
    return [host.get_data_page(int(i), flat=True).view(torch.uint8).numpy().tobytes() for i in idx[::PAGE]]


@pytest.mark.parametrize("layout,mla", [("page_first", False), ("layer_first", False), ("page_first", True)],
                         ids=["mha-page-first", "mha-layer-first", "mla"])
def test_pages_stored_from_one_host_pool_load_byte_exact_into_another(tmp_path, layout, mla):
    """Zero-copy v1: a server's pages, stored under SGLang's hashes, load
    into a fresh server's host pool (another backend, other pages) equal to
    the byte; the leading run of stored pages is what exists."""
    from transfer.adapters.sglang.hicache import KvferryHiCache

    rng = np.random.default_rng(7)
    first = _host_pool(layout, mla=mla)
    backend = _backend(tmp_path, first, mla=mla)
    assert isinstance(backend, KvferryHiCache) and backend.writer
    keys = _keys(rng, 6)
    src = _pages(first, rng, 6)
    assert backend.batch_set_v1(keys, src) == [True] * 6
    backend.close()

    second = _host_pool(layout, mla=mla)
    again = _backend(tmp_path, second, mla=mla)
    assert again.batch_exists(keys) == 6
    assert again.batch_exists([*keys[:3], _keys(rng, 1)[0], keys[4]]) == 3
    dst = _pages(second, rng, 6)
    assert again.batch_get_v1(keys, dst) == [True] * 6
    assert _bytes(second, dst) == _bytes(first, src)
    missing = _keys(rng, 2)
    before = _bytes(second, dst[:2 * PAGE])
    assert again.batch_get_v1(missing, dst[:2 * PAGE]) == [False, False]
    assert _bytes(second, dst[:2 * PAGE]) == before  # a miss writes nothing
    assert again.num_loaded == 6


def test_tp_ranks_keep_their_own_heads_and_an_mla_model_one_copy(tmp_path):
    """MHA: two TP ranks store the same page hashes with their own heads,
    each loads its own. MLA: only SGLang's storage writer (rank 0) stores,
    every rank loads that one copy."""
    rng = np.random.default_rng(8)
    keys = _keys(rng, 3)
    pools = [_host_pool() for _ in range(2)]
    ranks = [_backend(tmp_path, pools[r], tp_rank=r, tp_size=2) for r in range(2)]
    src = [_pages(pools[r], rng, 3) for r in range(2)]
    for r in range(2):
        assert ranks[r].batch_set_v1(keys, src[r]) == [True] * 3
    assert _bytes(pools[0], src[0]) != _bytes(pools[1], src[1])
    for r in range(2):
        fresh = _host_pool()
        loader = _backend(tmp_path, fresh, tp_rank=r, tp_size=2)
        dst = _pages(fresh, rng, 3)
        assert loader.batch_get_v1(keys, dst) == [True] * 3 and _bytes(fresh, dst) == _bytes(pools[r], src[r])

    mla = [_host_pool(mla=True) for _ in range(2)]
    writer, reader = (_backend(tmp_path, mla[r], tp_rank=r, tp_size=2, mla=True) for r in range(2))
    assert writer.writer and not reader.writer
    w_src, r_src = _pages(mla[0], rng, 3), _pages(mla[1], rng, 3)
    assert reader.batch_set_v1(keys, r_src) == [True] * 3  # not its to write: stored by the writer
    assert reader.batch_exists(keys) == 0
    assert writer.batch_set_v1(keys, w_src) == [True] * 3
    dst = _pages(mla[1], rng, 3)
    assert reader.batch_get_v1(keys, dst) == [True] * 3 and _bytes(mla[1], dst) == _bytes(mla[0], w_src)


def test_a_drafts_kv_is_stored_with_its_target_and_never_loaded_without_it(tmp_path):
    """v2, SGLang's pool-named calls: the target's and the draft's pages go
    together under the same hashes (the draft keyed apart); a prefix counts
    only as far as both have it; a draft page whose target page is missing
    is reported missing and not written into the host pool."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    rng = np.random.default_rng(9)
    keys = _keys(rng, 4)
    target, draft = _host_pool(), _host_pool(heads=1, layers=1)
    backend = _backend(tmp_path, target)
    backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    t_src, d_src = _pages(target, rng, 4), _pages(draft, rng, 4)
    put = backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=t_src, keys=keys),
                                PoolTransfer(name=PoolName.DRAFT, host_indices=d_src, keys=keys)])
    assert put == {"kv": [True] * 4, "draft": [True] * 4}
    # only the first two pages' drafts, from a second prompt that shares them
    more = _keys(rng, 2)
    assert backend.batch_set_v1(more, _pages(target, rng, 2)) == [True, True]
    hit = backend.batch_exists_v2(keys + more, [PoolTransfer(name=PoolName.DRAFT, keys=keys + more,
                                                             hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert hit.kv_hit_pages == 4 and hit.extra_pool_hit_pages == {"kv": 6, "draft": 4}

    # a draft page stored alone (its target evicted, or never written): in the store, never to be loaded
    lone = _keys(rng, 1)
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=_pages(draft, rng, 1),
                                              keys=lone)]) == {"draft": [True]}
    assert backend._exists(lone, "draft") == 1 and backend.batch_exists(lone) == 0

    t2, d2 = _host_pool(), _host_pool(heads=1, layers=1)
    loader = _backend(tmp_path, t2)
    loader.register_mem_host_pool_v2(d2, PoolName.DRAFT)
    t_dst, d_dst = _pages(t2, rng, 4), _pages(d2, rng, 4)
    asked = [keys[0], keys[1], lone[0], keys[3]]  # page 2's target is not in the store, its draft is
    before = _bytes(d2, d_dst)
    got = loader.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=d_dst, keys=asked),
                               PoolTransfer(name=PoolName.KV, host_indices=t_dst, keys=asked)])
    assert got == {"kv": [True, True, False, True], "draft": [True, True, False, True]}
    t_bytes, d_bytes = _bytes(t2, t_dst), _bytes(d2, d_dst)
    want_t, want_d = _bytes(target, t_src), _bytes(draft, d_src)
    assert [t_bytes[i] for i in (0, 1, 3)] == [want_t[i] for i in (0, 1, 3)]
    assert [d_bytes[i] for i in (0, 1, 3)] == [want_d[i] for i in (0, 1, 3)]
    assert d_bytes[2] == before[2]

    # SGLang 0.5.23 reads the target with batch_get_v1 and the draft in a v2 call of its own:
    # a draft page whose target the store lacks is still never written
    d_alone = _pages(d2, rng, 4)
    before = _bytes(d2, d_alone)
    got = loader.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=d_alone, keys=asked)])
    assert got == {"draft": [True, True, False, True]}
    alone_bytes = _bytes(d2, d_alone)
    assert [alone_bytes[i] for i in (0, 1, 3)] == [want_d[i] for i in (0, 1, 3)] and alone_bytes[2] == before[2]


def test_a_store_that_fails_makes_the_pages_missing_never_an_exception(tmp_path):
    """SGLang's storage threads must get per-page results: a closed store
    answers False for every page (and 0 for exists), logged, no raise, no None."""
    rng = np.random.default_rng(10)
    host = _host_pool()
    backend = _backend(tmp_path, host)
    keys = _keys(rng, 2)
    idx = _pages(host, rng, 2)
    backend.close()
    assert backend.batch_set_v1(keys, idx) == [False, False]
    assert backend.batch_get_v1(keys, idx) == [False, False]
    assert backend.batch_exists(keys) == 0
    assert backend.num_failed_calls == 3
    assert backend.batch_get_v1(keys, idx[:PAGE]) == [False, False]  # indices that do not match the keys


def test_the_hicache_benchmark_moves_every_page_byte_exact_through_each_backend(tmp_path):
    """``make bench-hicache``, small: SGLang's file backend and each kvferry
    store that runs here put and get every page (the run fails on a page
    read that differs from what was stored); the others are skipped with a
    reason."""
    import json

    from benchmarks.hicache import BACKENDS, main

    out = tmp_path / "bench.json"
    assert main(["--pages", "8", "--layers", "2", "--rounds", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    ran = {r["backend"] for r in data["rows"]}
    assert {"memcpy", "sglang-file", "kvferry-file"} <= ran
    assert ran | set(data["skipped"]) == {"memcpy", *BACKENDS} and not ran & set(data["skipped"])
    assert all(r["gbps"] > 0 and r["pages"] == 8 for r in data["rows"])
    assert {(s["backend"], s["op"]) for s in data["summary"]} >= {("sglang-file", "put"), ("kvferry-file", "get")}
