"""The storage tier with CUDA pools: host-memory backends refuse them before
touching a byte; NIXL GDS with ``memory=VRAM`` writes pages through from a
CUDA pool and restores them into another one byte-exact (or refuses clearly
where cuFile cannot run); NIXL POSIX cannot reach a CUDA pool and says so."""

import threading

import numpy as np
import pytest
import torch

from bootstrap.messages import PoolRole
from transfer import KVManager, ManagerConfig, MHAPool, Role
from transfer.errors import StorageError
from transfer.storage.nixl.probe import gds_unavailable_reason, nixl_missing_reason
from transfer.storage.tier import StorageTier
from transfer.transport.loopback import LoopbackFabric

SHAPE = (32, 16, 4, 64)


def _cuda_pool(seed: int) -> MHAPool:
    g = torch.Generator().manual_seed(seed)

    def rand():
        return torch.randint(-30000, 30000, SHAPE, dtype=torch.int16, generator=g).view(torch.bfloat16).cuda()
    return MHAPool(k=[rand() for _ in range(2)], v=[rand() for _ in range(2)])


def _config(url: str) -> ManagerConfig:
    return ManagerConfig(role=Role.PREFILL, storage_url=url, model_name="gpu-suite", staging_bytes=0)


def _device() -> int:
    return torch.cuda.current_device()


def test_a_manager_with_cuda_pools_and_a_file_store_is_refused(tmp_path):
    fabric = LoopbackFabric()
    with pytest.raises(StorageError, match=r"target pool: .*host memory only, not cuda:\d memory"):
        KVManager(_config(f"file://{tmp_path}"), [_cuda_pool(1)], transport=fabric.transport(),
                  channel_factory=fabric.channel)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


@pytest.mark.skipif(bool(nixl_missing_reason()), reason=f"nixl: {nixl_missing_reason()}")
def test_nixl_posix_cannot_reach_a_cuda_pool(tmp_path):
    with pytest.raises(StorageError, match=r"memory=DRAM serves cpu memory, not cuda:\d memory"):
        StorageTier(_config(f"nixl://{tmp_path}?backend=POSIX"), [_cuda_pool(2)], None, "gpu suite")
    with pytest.raises(ValueError, match="POSIX backend cannot reach GPU memory"):
        StorageTier(_config(f"nixl://{tmp_path}?backend=POSIX&memory=VRAM"), [_cuda_pool(2)], None, "gpu suite")


@pytest.mark.skipif(bool(nixl_missing_reason()), reason=f"nixl: {nixl_missing_reason()}")
@pytest.mark.parametrize("backend", ["GDS", "GDS_MT"])
def test_nixl_gds_writes_through_from_and_restores_into_cuda_pools(tmp_path, backend):
    url = f"nixl://{tmp_path}?backend={backend}&memory=VRAM&device_id={_device()}"
    why = gds_unavailable_reason(backend, "VRAM")
    src = _cuda_pool(3)
    if why:  # cuFile cannot run here: the store must refuse at once, naming why
        with pytest.raises(StorageError, match=backend):
            StorageTier(_config(url), [src], None, "gpu suite")
        return
    tier = StorageTier(_config(url), [src], None, "gpu suite")
    try:
        tokens = np.arange(16 * 8)  # 8 full pages
        keys = tier.keys(PoolRole.TARGET, tier.chains(tokens))
        pages = np.random.default_rng(4).permutation(32)[:8].tolist()
        done = threading.Event()
        job = tier.write({PoolRole.TARGET: (keys, pages)}, None, lambda j: done.set())
        assert done.wait(60) and job.error is None and job.pages[PoolRole.TARGET] == 8
        # Restore into other pages of the same pool (its registered memory), after wiping them.
        others = [p for p in range(32) if p not in pages][:8]
        for t in (*src.k, *src.v):
            t[others] = 0
        torch.cuda.synchronize()
        done.clear()
        job = tier.read({PoolRole.TARGET: (keys, others)}, None, lambda j: done.set())
        assert done.wait(60) and job.error is None and job.pages[PoolRole.TARGET] == 8
        for t in (*src.k, *src.v):
            assert torch.equal(t[others].view(torch.int16), t[pages].view(torch.int16))
    finally:
        tier.close()
