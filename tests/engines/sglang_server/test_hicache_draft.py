"""A speculative set-up's draft KV in kvferry's HiCache store (issue 43, item 2), with SGLang's own parts.

SGLang 0.5.23 does not run speculative decoding on this CPU, with or without
HiCache (``--speculative-algorithm STANDALONE`` with a tiny Llama as its own
draft, tried on the servers of ``test_hicache_server.py``):

- every MHA device pool of a speculative server builds a Triton KV copy at
  start-up (``MHATokenToKVPool._init_kv_copy_and_warmup``,
  ``enable_kv_cache_copy=speculative_algorithm is not None``): "RuntimeError:
  0 active drivers ([]). There should only be one." (its CPU variant,
  ``sgl_kernel.copy_all_layer_kv_cache_cpu``, is the CPU engine's, which no
  package index holds);
- past that (tried with a throwaway stand-in), the draft worker has no
  attention backend for the generic torch path:
  ``DraftBackendFactory.create_decode_backend`` (``speculative/draft_utils.py``)
  raises "EAGLE is not supported in decode attention backend torch_native"
  (its CPU entry, ``intel_amx``, is the CPU engine's again), and
  ``torch_native`` has no target-verify path at all; the EAGLE worker's
  draft steps are Triton kernels (``kernels/ops/speculative``).

So the draft's KV is tested here, in process, with the parts of SGLang that
move it, built by SGLang's own code as its scheduler builds them for HiCache
with a draft model (``base_spec_worker._build_hicache_draft_plan``):

- ``sidecar`` (STANDALONE, EAGLE, EAGLE3: a draft with its own KV pool):
  ``build_full_draft_pools`` gives the draft a host pool of its own and a
  ``SidecarPoolSpec(DRAFT, indices_from_pool=KV)``; the draft's pages go to the
  store by ``batch_set_v2``, keyed apart, its hits by ``batch_exists_v2``;
- ``packed`` (EAGLE with a NextN MTP layer): ``build_kv_only_group`` with
  ``mtp_draft_device_pools`` appends the draft's layers to the target's host
  pages: one store value holds both.

SGLang's ``HybridCacheController`` makes every storage call: its backup
(``_page_backup``), hit query (``_storage_hit_query``) and prefetch transfer
(``_page_transfer``), the methods its storage threads run (the threads, TP
sync groups and streams are not started: the test calls those methods in
their order). The device <-> host copies are SGLang's host-pool methods with
``--hicache-io-backend direct`` through the servers' stand-in copy
(``hicache_site``). A "computed" KV is random bytes in the device pools; the
check is the one that matters for a draft after an L3 hit (sglang#31600: an
accept rate of 0.98 falls to 0.10 when the draft's KV is not what its model
computed): a restarted server's device pools, loaded from the store, hold
the target's and the draft's KV byte for byte as computed.
"""

from __future__ import annotations

import importlib
import os
import queue
import random
import runpy
import types
from dataclasses import dataclass

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hicache_site")
PAGE = 16
TARGET_LAYERS, DRAFT_LAYERS = 4, 2  # the tiny Llama; a smaller draft (SGLang: no more layers than the target)
MTP_LAYERS = 1  # one NextN layer, packed
KV_HEADS, HEAD_DIM = 4, 32
MODEL = "tiny-llama"
SLOTS = 64 * PAGE  # device pool tokens


@pytest.fixture(scope="module", autouse=True)
def sglang_on_this_cpu():
    """The servers' stand-ins (and torchvision's) in this process, and
    SGLang's runtime config as a HiCache server with these flags publishes it."""
    site = runpy.run_path(os.path.join(SITE, "sitecustomize.py"))
    for name, patch in site["_PATCHES"].items():
        patch(importlib.import_module(name))
    from sglang.srt.runtime_context import get_context

    config = get_context().override_server_args(device="cpu", page_size=PAGE, hicache_mem_layout="layer_first",
                                                 hicache_ratio=2.0, hicache_size=0, hicache_io_backend="direct")
    config.install()
    yield
    config.restore()


def device_pool(layers: int):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=SLOTS, page_size=PAGE, dtype=torch.bfloat16, head_num=KV_HEADS, head_dim=HEAD_DIM,
                            layer_num=layers, device="cpu", enable_memory_saver=False, start_layer=0,
                            end_layer=layers)


@dataclass
class HiCacheNode:
    """One server's HiCache with a draft: device pools, SGLang's host pool
    group and its controller on kvferry's backend."""

    mode: str  # "sidecar" or "packed"
    target: object  # device pools
    draft: object
    group: object  # HostPoolGroup
    controller: object  # HybridCacheController
    sidecars: list  # SidecarPoolSpec

    @property
    def backend(self):
        return self.controller.storage_backend

    def pool_transfers(self) -> list:
        """The storage op's pool transfers, as SGLang's radix cache adds them for its sidecars."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        return [PoolTransfer(name=s.pool_name, hit_policy=s.hit_policy, indices_from_pool=s.indices_from_pool)
                for s in self.sidecars]

    def close(self) -> None:
        self.backend.close()


def hicache_node(mode: str, store_url: str) -> HiCacheNode:
    """Built as SGLang 0.5.23 builds it: ``build_kv_only_group`` (target, and
    in ``packed`` mode the draft's layers in the same host pages), then in
    ``sidecar`` mode ``build_full_draft_pools`` for the draft, registered
    with the storage backend as ``attach_storage_backend`` registers pools.
    The controller holds what ``attach_storage_backend`` sets for a
    ``dynamic`` backend with ``interface_v1`` (zero-copy get and set)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_full_draft_pools, build_kv_only_group
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    target = device_pool(TARGET_LAYERS)
    draft = device_pool(DRAFT_LAYERS if mode == "sidecar" else MTP_LAYERS)
    group = build_kv_only_group(page_size=PAGE, kv_pool=target, full_layer_mapping={i: i for i in range(TARGET_LAYERS)},
                                use_mla=False, mtp_draft_device_pools=(draft,) if mode == "packed" else ())
    controller = HybridCacheController.__new__(HybridCacheController)
    controller.mem_pool_host, controller.page_size = group, PAGE
    controller.transfer_layer_id_max = TARGET_LAYERS
    sidecars, entries = [], []
    if mode == "sidecar":
        sidecars, entries = build_full_draft_pools(draft_kv_pool=draft,
                                                   tree_cache=types.SimpleNamespace(cache_controller=controller))
        for entry in entries:
            group.add_entry(entry)
    extra = {"backend_name": "kvferry", "module_path": "transfer.adapters.sglang.hicache",
             "class_name": "KvferryHiCache", "interface_v1": 1, "kvferry_storage_url": store_url}
    controller.storage_config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=MODEL, extra_config=extra)
    controller.storage_host_pool = group.anchor_entry.host_pool
    controller.storage_backend_type = "dynamic"
    controller.storage_backend = StorageBackendFactory.create_backend("dynamic", controller.storage_config,
                                                                      controller.storage_host_pool)
    controller.storage_backend.register_mem_pool_host(controller.storage_host_pool)
    for entry in entries:
        controller.storage_backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
    controller.page_get_func, controller.page_set_func = (controller._page_get_zero_copy,
                                                          controller._page_set_zero_copy)
    controller.prefetch_sync_queue = queue.Queue()
    return HiCacheNode(mode, target, draft, group, controller, sidecars)


def slots(first_page: int, num_pages: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + num_pages) * PAGE)


def prompt_of(num_pages: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(num_pages * PAGE)]


def page_hashes(tokens: list[int]) -> list[str]:
    from sglang.srt.mem_cache.utils import get_hash_str

    out, prior = [], None
    for i in range(len(tokens) // PAGE):
        prior = get_hash_str(tokens[i * PAGE:(i + 1) * PAGE], prior)
        out.append(prior)
    return out


def kv_buffers(pool) -> list[torch.Tensor]:
    return list(pool.k_buffer) + list(pool.v_buffer)


def compute(node: HiCacheNode, device_slots: torch.Tensor, seed: int) -> None:
    """Stands for the forward passes: the prompt's KV in the target's and the draft's device pools."""
    gen = torch.Generator().manual_seed(seed)
    for buf in kv_buffers(node.target) + kv_buffers(node.draft):
        buf[device_slots] = torch.randn(buf[device_slots].shape, generator=gen).to(buf.dtype)


def write_through(node: HiCacheNode, tokens: list[int], device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
    """Device -> host (the host pools' own ``direct`` copies; a packed host
    pool copies the draft's layers with the target's), then SGLang's backup
    thread's call: ``_page_backup`` of a storage op with the draft sidecar."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import StorageOperation

    node.group.get_pool(PoolName.KV).backup_from_device_all_layer(node.target, host_slots, device_slots, "direct")
    if node.mode == "sidecar":
        node.group.get_pool(PoolName.DRAFT).backup_from_device_all_layer(node.draft, host_slots, device_slots,
                                                                         "direct")
    op = StorageOperation(host_slots, tokens, hash_value=page_hashes(tokens),
                          pool_transfers=node.pool_transfers() or None)
    node.controller._page_backup(op)
    assert op.completed_tokens == len(tokens)


@dataclass
class Prefetch:
    hit_pages: int  # SGLang's hit query
    pool_hit_pages: dict  # each pool's own, as kvferry's batch_exists_v2 reported it
    completed_pages: int  # what SGLang's prefetch acks say it loaded (what it then uses)


def prefetch(node: HiCacheNode, tokens: list[int], host_slots: torch.Tensor, before_transfer=None) -> Prefetch:
    """SGLang's prefetch thread and IO thread for one request: the hit
    query, the op cut to the hit, then the transfer into ``host_slots``."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation

    op = PrefetchOperation(CacheRequestHandle(rid="r", attempt_id=0), tokens, None,
                           pool_transfers=node.pool_transfers() or None)
    hashes, hit_tokens = node.controller._storage_hit_query(op)
    op.hash_value, op.storage_hit_count = hashes[:hit_tokens // PAGE], hit_tokens
    op.host_indices = host_slots[:hit_tokens]
    if before_transfer is not None:
        before_transfer()
    node.controller._page_transfer(op)
    completed = 0
    while not node.controller.prefetch_sync_queue.empty():
        ack = node.controller.prefetch_sync_queue.get_nowait()
        if ack.completed_tokens is not None:
            completed = ack.completed_tokens // PAGE
    return Prefetch(hit_tokens // PAGE, {str(k): v for k, v in op.query_pool_hit_pages.items()}, completed)


def load_to_device(node: HiCacheNode, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
    """Host -> device, layer by layer as SGLang's load does (a packed draft's
    layers come after the target's in the same host pool)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv_host = node.group.get_pool(PoolName.KV)
    for layer in range(TARGET_LAYERS):
        kv_host.load_to_device_per_layer(node.target, host_slots, device_slots, layer, "direct")
    for layer in range(node.draft.layer_num):
        if node.mode == "packed":
            kv_host.load_to_device_per_layer(node.target, host_slots, device_slots, TARGET_LAYERS + layer, "direct",
                                             is_draft=True)
        else:
            node.group.get_pool(PoolName.DRAFT).load_to_device_per_layer(node.draft, host_slots, device_slots,
                                                                         layer, "direct")


def same_kv(pool_a, slots_a: torch.Tensor, pool_b, slots_b: torch.Tensor) -> bool:
    return all(torch.equal(a[slots_a], b[slots_b]) for a, b in zip(kv_buffers(pool_a), kv_buffers(pool_b), strict=True))


def store_files(root: str) -> dict[str, int]:
    """The file store's files: name (the key) -> bytes."""
    return {name: os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(root) for name in names}


def remove_from_store(root: str, key: str) -> None:
    """A value gone from the store (evicted, or deleted by another server)."""
    os.unlink(next(os.path.join(d, key) for d, _, names in os.walk(root) if key in names))


def page_bytes(layers: int) -> int:
    return PAGE * layers * 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16


@pytest.mark.parametrize("mode", ["sidecar", "packed"])
def test_a_draft_is_stored_and_loaded_with_its_target_and_equals_its_computed_kv(tmp_path, mode):
    """A server computes a 20-page prompt and writes it through; a restarted
    server (other pools, another backend, the same store) finds it with
    SGLang's hit query for both pools, loads it, and its device pools hold
    the target's and the draft's KV equal to the byte to what was computed.
    The store's files: ``sidecar``, one value per page and pool, the draft's
    keyed apart (``<hash>.draft_<model>...``), of the draft's size; ``packed``, one value
    per page holding the target's and the draft's layers."""
    root = str(tmp_path / "l3")
    tokens = prompt_of(20, seed=1)
    first = hicache_node(mode, f"file://{root}")
    computed_at = torch.randperm(SLOTS // PAGE)[:20]  # scattered device pages, as a server's allocator leaves them
    device_slots = torch.cat([slots(int(p), 1) for p in computed_at])
    compute(first, device_slots, seed=2)
    write_through(first, tokens, device_slots, slots(10, 20))
    first.close()

    keys = page_hashes(tokens)
    files = store_files(root)
    kv_keys = set(first.backend.store_keys(keys))
    draft_keys = set(first.backend.store_keys(keys, "draft"))
    assert kv_keys.isdisjoint(draft_keys) and all(".draft_" in k for k in draft_keys)
    assert len({k[:2] for k in draft_keys}) > 1  # the draft's files spread over the store's directories
    if mode == "sidecar":
        assert set(files) == kv_keys | draft_keys
        kv_size, draft_size = {files[k] for k in kv_keys}, {files[k] for k in draft_keys}
        assert len(kv_size) == len(draft_size) == 1
        assert kv_size.pop() - draft_size.pop() == page_bytes(TARGET_LAYERS) - page_bytes(DRAFT_LAYERS)
    else:
        assert set(files) == kv_keys  # the draft's layers are in the target's values

    restarted = hicache_node(mode, f"file://{root}")
    got = prefetch(restarted, tokens, slots(40, 20))
    assert got.hit_pages == got.completed_pages == 20
    if mode == "sidecar":
        assert got.pool_hit_pages == {"kv": 20, "draft": 20}
    loaded_at = slots(3, 20)
    assert not same_kv(restarted.draft, loaded_at, first.draft, device_slots)  # nothing there before the load
    load_to_device(restarted, slots(40, 20), loaded_at)
    assert same_kv(restarted.target, loaded_at, first.target, device_slots)
    assert same_kv(restarted.draft, loaded_at, first.draft, device_slots)
    assert restarted.backend.num_loaded == 20 and restarted.backend.num_failed_calls == 0
    restarted.close()


def test_a_draft_is_used_only_as_far_as_its_target_is_in_the_store(tmp_path):
    """Sidecar draft. The target's value of page 8 gone from the store:
    SGLang's hit query stops there for both pools (kvferry's
    ``batch_exists_v2`` counts a prefix only as far as every pool has it,
    though the draft's pages from 8 on are still stored), and the 8 pages
    load byte-exact, target and draft. The draft's value of page 5 gone: the
    hit stops at 5 (a target without its draft is no use to a speculative
    server either). Gone between SGLang's hit query and its read (the read
    is ``batch_get_v1`` for the target, then ``batch_get_v2`` for the draft,
    a call of its own): SGLang counts the pages both loaded, so the draft is
    used only as far as its target loaded."""
    root = str(tmp_path / "l3")
    first = hicache_node("sidecar", f"file://{root}")
    tokens, racy = prompt_of(12, seed=3), prompt_of(6, seed=4)
    for seed, (prompt, computed_at) in enumerate(((tokens, slots(0, 12)), (racy, slots(20, 6)))):
        compute(first, computed_at, seed=seed)
        write_through(first, prompt, computed_at, computed_at)
    first.close()

    node = hicache_node("sidecar", f"file://{root}")
    keys = page_hashes(tokens)
    remove_from_store(root, node.backend.store_keys([keys[8]])[0])
    got = prefetch(node, tokens, slots(30, 12))
    assert (got.hit_pages, got.completed_pages, got.pool_hit_pages) == (8, 8, {"kv": 8, "draft": 8})
    load_to_device(node, slots(30, 8), slots(40, 8))
    assert same_kv(node.target, slots(40, 8), first.target, slots(0, 8))
    assert same_kv(node.draft, slots(40, 8), first.draft, slots(0, 8))

    remove_from_store(root, node.backend.store_keys([keys[5]], "draft")[0])
    got = prefetch(node, tokens, slots(50, 12))
    assert (got.hit_pages, got.completed_pages, got.pool_hit_pages) == (5, 5, {"kv": 8, "draft": 5})

    gone = node.backend.store_keys([page_hashes(racy)[3]])[0]
    got = prefetch(node, racy, slots(10, 6), before_transfer=lambda: remove_from_store(root, gone))
    assert (got.hit_pages, got.completed_pages, got.pool_hit_pages) == (6, 3, {"kv": 6, "draft": 6})
    node.close()
