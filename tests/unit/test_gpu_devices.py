"""The GPU path's checks that need no GPU: duck-typed "CUDA" tensors backed
by host memory (tests/unit/_fakecuda.py) and monkeypatched CUDA calls.

- storage refuses device pools before touching a byte (file, Mooncake Store,
  NIXL DRAM; NIXL VRAM only for its own GPU);
- a KVManager refuses the non-CUDA Mooncake wheel for CUDA pools;
- staging follows the pools' device, with its own default size there;
- pool tensors that are views of one allocation register it once;
- page ids and tokens may be CUDA tensors;
- gather/scatter run on a private stream and synchronise only it; the
  index_copy_ scatter branch (the one CUDA takes) moves the same bytes.
"""

import contextlib
import random

import numpy as np
import pytest
import torch

from ._fakecuda import FakeCudaTensor, fake_cuda
from ._rooms import Role, assert_landed, random_pages, run_room
from bootstrap.server import BootstrapServer
from transfer import KVManager, ManagerConfig, MHAPool, MLAPool
from transfer.config import DEFAULT_STAGING_BYTES, default_staging_bytes, manager_config_from_env
from transfer.errors import StorageError, TransferError
from transfer.plan import page_slice, staged_bytes
from transfer.pools import describe_pool, host_page_ids, memory_regions, pool_tensors, registration_regions
from transfer.staging import copies
from transfer.staging.copies import gather, scatter
from transfer.storage.base import StorageBackend
from transfer.storage.file import FileStore
from transfer.storage.mooncake.store import MooncakeStore
from transfer.storage.nixl.config import NixlStoreConfig
from transfer.storage.nixl.store import NixlStore
from transfer.storage.tier import StorageTier
from transfer.transport.mooncake import process as mooncake_process
from transfer.transport.loopback import LoopbackFabric

SHAPE = (16, 4, 2, 8)


@contextlib.contextmanager
def _server():
    server = BootstrapServer("127.0.0.1", 0).start()
    try:
        yield server
    finally:
        server.close()


def _cuda_pool(index: int = 0) -> MHAPool:
    return MHAPool(k=fake_cuda([torch.ones(SHAPE, dtype=torch.bfloat16)] * 2, index),
                   v=fake_cuda([torch.ones(SHAPE, dtype=torch.bfloat16)] * 2, index))


_real_zeros = torch.zeros


def _device_zeros(log):
    """``torch.zeros`` that records (and allocates on the host) what asks for
    a CUDA device; ``log`` None: such a call fails the test."""
    def zeros(*args, **kw):
        device = kw.get("device")
        if device is None or torch.device(device).type == "cpu":
            return _real_zeros(*args, **kw)
        if log is None:
            pytest.fail(f"device memory allocated: {args} {kw}")
        log.append((args[0], torch.device(device)))
        return _real_zeros(*args, **{**kw, "device": "cpu"})
    return zeros


def _config(role=Role.PREFILL, **kw) -> ManagerConfig:
    return ManagerConfig(role=role, bootstrap_addr="127.0.0.1:1", register_timeout_s=0.2, **kw)


# --- storage ---------------------------------------------------------------------


def test_the_storage_tier_refuses_cuda_pools_for_the_file_store_before_writing(tmp_path):
    root = tmp_path / "store"
    cfg = _config(storage_url=f"file://{root}", model_name="m")
    with pytest.raises(StorageError, match=r"target pool: .*host memory only, not cuda:0 memory"):
        StorageTier(cfg, [_cuda_pool()], None, "prefill rank 0")
    assert not any(p.is_file() for p in root.rglob("*")), "the refused store wrote something"


def test_the_storage_tier_refuses_a_cuda_aux_tensor(tmp_path):
    pool = MHAPool(k=[torch.ones(SHAPE, dtype=torch.bfloat16)], v=[torch.ones(SHAPE, dtype=torch.bfloat16)])
    aux = FakeCudaTensor(torch.zeros(4, 16, dtype=torch.uint8))
    with pytest.raises(StorageError, match="aux tensor"):
        StorageTier(_config(storage_url=f"file://{tmp_path}", model_name="m"), [pool], aux, "prefill rank 0")


def test_host_memory_backends_refuse_device_memory_and_accept_the_cpu(tmp_path):
    """File and Mooncake Store keep the base rule (host memory only); their
    upsert memmoves and CRCs would crash on a device pointer."""
    assert FileStore.check_memory is StorageBackend.check_memory
    assert MooncakeStore.check_memory is StorageBackend.check_memory
    store = MooncakeStore.__new__(MooncakeStore)
    store.url = "mooncake://master:50051"
    with pytest.raises(StorageError, match="mooncake://master:50051: .*not cuda:1 memory"):
        store.check_memory("cuda:1")
    store.check_memory("cpu")


@pytest.mark.parametrize("memory,device_id,device,ok", [
    ("DRAM", 0, "cpu", True), ("DRAM", 0, "cuda:0", False), ("VRAM", 0, "cuda:0", True),
    ("VRAM", 0, "cuda", True), ("VRAM", 1, "cuda:0", False), ("VRAM", 1, "cuda:1", True), ("VRAM", 0, "cpu", False)])
def test_the_nixl_store_serves_only_the_memory_it_was_configured_for(tmp_path, memory, device_id, device, ok):
    store = NixlStore.__new__(NixlStore)
    store.config = NixlStoreConfig(root=str(tmp_path), backend="GDS", memory=memory, device_id=device_id)
    store.url = "nixl://x"
    if ok:
        store.check_memory(device)
    else:
        with pytest.raises(StorageError, match=f"memory={memory}.*not {device} memory"):
            store.check_memory(device)


def test_a_manager_with_cuda_pools_and_a_file_store_is_refused_at_construction(tmp_path, monkeypatch):
    zeros = []
    monkeypatch.setattr(torch, "zeros", _device_zeros(zeros))
    with _server() as server:
        fabric = LoopbackFabric()
        cfg = ManagerConfig(role=Role.DECODE, bootstrap_addr=server.address, storage_url=f"file://{tmp_path}",
                            model_name="m", staging_bytes=1 << 20, stage_part_bytes=1 << 19)
        with pytest.raises(StorageError, match="decode .*target pool.*cuda:0"):
            KVManager(cfg, [_cuda_pool()], transport=fabric.transport(), channel_factory=fabric.channel)
    assert zeros == [(1 << 20, torch.device("cuda", 0))]  # staging on the pools' device


# --- the Mooncake wheel ------------------------------------------------------------


@pytest.mark.parametrize("builds,ok", [
    (["mooncake-transfer-engine-non-cuda"], False), (["mooncake-transfer-engine-efa-non-cuda"], False),
    (["mooncake-transfer-engine"], True), (["mooncake-transfer-engine-cuda13"], True), ([], True)])
def test_only_a_cuda_build_of_mooncake_takes_cuda_pools(builds, ok):
    if ok:
        mooncake_process.check_engine_build("cuda", builds)
    else:
        with pytest.raises(TransferError, match="cannot read or write device memory: install "
                                                "mooncake-transfer-engine"):
            mooncake_process.check_engine_build("cuda", builds)
    mooncake_process.check_engine_build("cpu", ["mooncake-transfer-engine-non-cuda"])


def test_a_manager_refuses_the_non_cuda_wheel_before_building_an_engine(monkeypatch):
    monkeypatch.setattr(mooncake_process, "installed_builds", lambda: ["mooncake-transfer-engine-non-cuda"])

    def no_engine(*a, **kw):
        pytest.fail("an engine was built for CUDA pools with the non-CUDA wheel")
    # Where the manager builds it through (build_transport imports it from there when called).
    monkeypatch.setattr("transfer.transport.mooncake.transport.MooncakeTransport", no_engine)
    monkeypatch.setattr(torch, "zeros", _device_zeros(None))
    with pytest.raises(TransferError, match="mooncake-transfer-engine-non-cuda"):
        KVManager(_config(), [_cuda_pool()])


def test_this_machines_wheel_is_known():
    """The venv's own wheel is recognised (the refusal above is not vacuous here)."""
    builds = mooncake_process.installed_builds()
    assert builds, "mooncake is installed from a wheel in the test venv"
    cuda = any(b in mooncake_process.CUDA_BUILDS for b in builds)
    if not cuda:
        with pytest.raises(TransferError):
            mooncake_process.check_engine_build("cuda")


# --- staging size by device ------------------------------------------------------------


def test_the_default_staging_follows_the_pools_device(monkeypatch):
    assert default_staging_bytes("cpu") == 256 << 20
    assert default_staging_bytes("cuda") == DEFAULT_STAGING_BYTES["cuda"] == 64 << 20
    made = []
    monkeypatch.setattr(torch, "zeros", _device_zeros(made))
    with _server() as server:
        fabric = LoopbackFabric()
        cfg = ManagerConfig(role=Role.DECODE, bootstrap_addr=server.address)
        assert cfg.staging_bytes is None
        with KVManager(cfg, [_cuda_pool()], transport=fabric.transport(), channel_factory=fabric.channel) as mgr:
            assert mgr.rank.staging.nbytes == 64 << 20
        assert made == [(64 << 20, torch.device("cuda", 0))]
        cpu_pool = MHAPool(k=[torch.ones(SHAPE, dtype=torch.bfloat16)], v=[torch.ones(SHAPE, dtype=torch.bfloat16)])
        with KVManager(cfg, [cpu_pool], transport=fabric.transport(), channel_factory=fabric.channel) as mgr:
            # Fenced (the default on decode): the descriptor names the reserved span of
            # arenas; the live arenas hold the staging bytes.
            assert mgr.rank.fenced and mgr.context.staging.area.nbytes == 256 << 20
        explicit = ManagerConfig(role=Role.DECODE, bootstrap_addr=server.address, staging_bytes=0)
        with KVManager(explicit, [_cuda_pool()], transport=fabric.transport(), channel_factory=fabric.channel) as mgr:
            assert mgr.rank.staging is None
    assert len(made) == 1


def test_staging_bytes_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVFERRY_STAGING_BYTES", str(128 << 20))
    assert manager_config_from_env(Role.DECODE).staging_bytes == 128 << 20
    monkeypatch.setenv("KVFERRY_STAGING_BYTES", "none")
    assert manager_config_from_env(Role.DECODE).staging_bytes is None
    with pytest.raises(ValueError, match="staging_bytes"):
        ManagerConfig(role=Role.DECODE, staging_bytes=-1)


# --- registration ------------------------------------------------------------------------


def test_views_of_one_allocation_register_it_once():
    block = torch.zeros((2, 3) + SHAPE, dtype=torch.bfloat16)  # [K/V, layer, pages, ...]: vLLM-style
    pool = MHAPool(k=[block[0, i] for i in range(3)], v=[block[1, i] for i in range(3)])
    storage = block.untyped_storage()
    assert registration_regions([pool]) == [(storage.data_ptr(), storage.nbytes())]
    separate = MHAPool(k=[torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(2)],
                       v=[torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(2)])
    aux = torch.zeros(4, 16, dtype=torch.uint8)
    from transfer.pools import describe_aux
    assert registration_regions([separate], aux) == memory_regions([describe_pool(separate)], describe_aux(aux))


def test_a_pool_of_views_of_one_allocation_moves_byte_exact():
    """The loopback transport checks every address against what was
    registered: the whole allocation, registered once, covers every view."""
    from transfer import KVPoll, KVReceiver, KVSender

    from ._rooms import FAST, NUM_LAYERS, wait_until
    shape = (32, 4, 2, 8)
    rng = np.random.default_rng(9)
    blocks = {Role.PREFILL: torch.from_numpy(rng.integers(0, 1 << 15, (2, NUM_LAYERS) + shape, dtype=np.int16)),
              Role.DECODE: torch.zeros((2, NUM_LAYERS) + shape, dtype=torch.int16)}
    fabric, mgrs = LoopbackFabric(), {}
    with _server() as server, contextlib.ExitStack() as stack:
        for role, block in blocks.items():
            pool = MHAPool(k=[block[0, i] for i in range(NUM_LAYERS)], v=[block[1, i] for i in range(NUM_LAYERS)])
            cfg = ManagerConfig(role=role, bootstrap_addr=server.address, **FAST)
            mgrs[role] = stack.enter_context(KVManager(cfg, [pool], transport=fabric.transport(),
                                                       channel_factory=fabric.channel))
        assert len(mgrs[Role.DECODE].transport.regions) == 1
        src, dst = rng.permutation(32)[:10], rng.permutation(32)[:10]
        receiver = KVReceiver(mgrs[Role.DECODE], server.address, 1)
        receiver.init(dst)
        sender = KVSender(mgrs[Role.PREFILL], None, 1)
        wait_until(mgrs[Role.PREFILL], lambda: sender.poll() is not KVPoll.Bootstrapping, what="sender ready")
        sender.init(10)
        sender.send(src, last=True)
        wait_until(mgrs[Role.DECODE], lambda: receiver.poll() is KVPoll.Success, what="room landed")
    assert torch.equal(blocks[Role.DECODE][:, :, dst], blocks[Role.PREFILL][:, :, src])
    assert blocks[Role.DECODE].sum() == blocks[Role.DECODE][:, :, dst].sum()  # nothing else written


# --- host-only inputs ------------------------------------------------------------------------


def test_page_ids_on_a_cuda_device_are_copied_to_the_host_once():
    ids = FakeCudaTensor(torch.tensor([5, 3, 9]))
    with pytest.raises(TypeError):
        np.asarray(ids, dtype=np.int64)  # what send() did before
    out = host_page_ids(ids)
    assert out.dtype == np.int64 and out.tolist() == [5, 3, 9] and ids.cpu_calls == 1
    assert host_page_ids([1, 2]).tolist() == [1, 2]
    assert host_page_ids(torch.tensor([[4], [7]])).tolist() == [4, 7]
    assert host_page_ids(np.array([8], dtype=np.int32)).tolist() == [8]


def test_send_and_init_take_cuda_page_ids_and_tokens(cluster, tmp_path):
    prefill = cluster.rank(Role.PREFILL)
    decode = cluster.rank(Role.DECODE, storage_url=f"file://{tmp_path}", model_name="m")
    rng = np.random.default_rng(4)
    src, dst = random_pages(rng, 12), random_pages(rng, 12)
    tokens = FakeCudaTensor(torch.arange(48))
    run_room(prefill, decode, 4, FakeCudaTensor(torch.from_numpy(src)), FakeCudaTensor(torch.from_numpy(dst)),
             chunks=1, token_ids=tokens)
    assert_landed(prefill, decode, src, dst)


# --- staging copies on "CUDA" ---------------------------------------------------------------------


def _pools(seed):
    g = torch.Generator().manual_seed(seed)
    shape = (10, 4, 4, 6)
    return MHAPool(k=[torch.randint(-300, 300, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
                      for _ in range(2)],
                   v=[torch.randint(-300, 300, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
                      for _ in range(2)], total_kv_heads=8)


class _Stream:
    def __init__(self, log) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("stream.synchronize")


def test_gather_and_scatter_run_on_the_private_stream_and_sync_only_it(monkeypatch):
    log = []
    stream = _Stream(log)

    class _Context:
        def __init__(self, s):
            assert s is stream
            self.s = s

        def __enter__(self):
            log.append("enter")

        def __exit__(self, *exc):
            log.append("exit")

    monkeypatch.setattr(copies, "copy_stream", lambda device: stream)
    monkeypatch.setattr(torch.cuda, "stream", _Context)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("the device was synchronised"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: pytest.fail("the shared stream was used"))
    src, dst = _pools(1), _pools(2)
    sd, dd = describe_pool(src), describe_pool(dst)
    st, dt = pool_tensors([src]), pool_tensors([dst])
    sl = page_slice(sd, 0, 4)
    staging = torch.zeros(staged_bytes(sd, sl, 3), dtype=torch.uint8)
    gather(staging, 0, st, sd, sl, torch.tensor([7, 1, 4]))
    assert log == ["enter", "exit", "stream.synchronize"]
    log.clear()
    cache = {}
    scatter(staging, 0, dt, dd, sl, torch.tensor([0, 9, 2]), cache)
    for words in [w for k, w in cache.items() if k[0] != "addrs"]:
        words.arrays = None  # what a CUDA pool has: the index_copy_ branch
    log.clear()
    scatter(staging, 0, dt, dd, sl, torch.tensor([3, 5, 6]), cache)
    assert log == ["enter", "exit", "stream.synchronize"]
    for key in st:
        want = st[key][[7, 1, 4]].view(torch.int16)  # bytes, not values (NaNs differ from themselves)
        assert torch.equal(dt[key][[0, 9, 2]].view(torch.int16), want)
        assert torch.equal(dt[key][[3, 5, 6]].view(torch.int16), want)


def test_the_index_copy_scatter_branch_moves_the_same_bytes_as_numpys():
    src = _pools(3)
    sd = describe_pool(src)
    st = pool_tensors([src])
    for soff, n in [(0, 4), (1, 2), (3, 1)]:
        sl = page_slice(sd, soff, n)
        pages = random.Random(soff).sample(range(10), 6)
        staging = torch.zeros(staged_bytes(sd, sl, 6), dtype=torch.uint8)
        gather(staging, 0, st, sd, sl, torch.tensor(pages))
        outs, fresh = [], pool_tensors([_pools(4)])
        for force_torch in (False, True):
            dst = _pools(4)
            dd, dt = describe_pool(dst), pool_tensors([dst])
            cache = {}
            if force_torch:
                from transfer.staging.copies import _pool_words
                words = _pool_words(staging, 0, dt, dd, sl, cache)
                words.arrays = None
            scatter(staging, 0, dt, dd, sl, torch.tensor(list(range(6))), cache)
            outs.append({k: v.clone() for k, v in dt.items()})
        for key in outs[0]:
            assert torch.equal(outs[0][key].view(torch.int16), outs[1][key].view(torch.int16))
            assert not torch.equal(outs[1][key].view(torch.int16), fresh[key].view(torch.int16)), "nothing moved"


def test_page_ids_stay_on_the_host_for_a_cpu_staging_buffer():
    t = copies.page_tensor(np.array([3, 1], dtype=np.int32), torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [3, 1]
    assert copies.copy_stream(torch.device("cpu")) is None


def test_mla_pools_of_fake_cuda_tensors_describe_like_cpu_ones():
    cpu = MLAPool(latent=[torch.zeros((8, 4, 72), dtype=torch.bfloat16) for _ in range(2)])
    cuda = MLAPool(latent=fake_cuda(cpu.latent))
    a, b = describe_pool(cpu), describe_pool(cuda)
    assert a == b
