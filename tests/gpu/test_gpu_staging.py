"""Staging copies on the device: gather and scatter of CUDA pools match the
CPU result byte for byte, run on the private copy stream (not the current
one), and wait for that stream only."""

import random

import numpy as np
import pytest
import torch

from transfer.plan import page_slice, staged_bytes
from transfer.pools import MHAPool, MLAPool, describe_pool, pool_tensors
from transfer.staging import copies
from transfer.staging.copies import gather, scatter


def _mha(pages, heads, layout, seed, device):
    g = torch.Generator().manual_seed(seed)
    shape = (pages, 4, heads, 8) if layout == "nhd" else (pages, heads, 4, 8)

    def rand():
        return torch.randint(-30000, 30000, shape, dtype=torch.int16, generator=g).view(torch.bfloat16).to(device)
    return MHAPool(k=[rand() for _ in range(2)], v=[rand() for _ in range(2)], total_kv_heads=8, layout=layout)


def _bytes(tensors):
    return {k: v.cpu().view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("soff,doff,n", [(0, 0, 4), (2, 0, 2), (3, 1, 1)])
def test_device_gather_scatter_equals_the_cpu_result(layout, soff, doff, n):
    out = {}
    for device in ("cpu", "cuda"):
        src, dst = _mha(10, 4, layout, 1, device), _mha(12, 4, layout, 2, device)
        sd, dd = describe_pool(src), describe_pool(dst)
        st, dt = pool_tensors([src]), pool_tensors([dst])
        sl_s, sl_d = page_slice(sd, soff, n), page_slice(dd, doff, n)
        src_pages, dst_pages = random.Random(3).sample(range(10), 6), random.Random(4).sample(range(12), 6)
        staging = torch.zeros(staged_bytes(sd, sl_s, 6) + 4096, dtype=torch.uint8, device=device)
        gather(staging, 0, st, sd, sl_s, copies.page_tensor(np.array(src_pages), staging.device))
        scatter(staging, 0, dt, dd, sl_d, copies.page_tensor(np.array(dst_pages), staging.device))
        out[device] = (_bytes(dt), staging.cpu().numpy().tobytes())
    assert out["cuda"] == out["cpu"]


def test_copies_run_on_the_private_stream_and_leave_the_current_one_alone():
    device = torch.device("cuda", torch.cuda.current_device())
    stream = copies.copy_stream(device)
    assert stream is copies.copy_stream(device) and stream != torch.cuda.current_stream(device)
    pool = MLAPool(latent=[torch.randint(0, 255, (64, 4, 72), dtype=torch.uint8).view(torch.uint8).to(device)
                           for _ in range(2)])
    pd, pt = describe_pool(pool), pool_tensors([pool])
    sl = page_slice(pd, 0, 1)
    staging = torch.zeros(staged_bytes(pd, sl, 32), dtype=torch.uint8, device=device)
    # A long kernel on the current stream: a gather that synchronised the device
    # (or used this stream) would wait for it.
    torch.cuda._sleep(2_000_000_000)
    start = torch.cuda.Event(enable_timing=False)
    start.record()
    gather(staging, 0, pt, pd, sl, copies.page_tensor(np.arange(32), device))
    assert not start.query(), "the gather waited for the current stream's work"
    torch.cuda.synchronize(device)
    want = torch.cat([pt[k][:32].reshape(32, -1) for k in sorted(pt, key=lambda k: k[1])], dim=1)
    assert torch.equal(staging.view(2, 32, -1).permute(1, 0, 2).reshape(32, -1).cpu(), want.cpu())


def test_page_ids_go_pinned_to_the_device():
    device = torch.device("cuda", torch.cuda.current_device())
    t = copies.page_tensor(np.array([5, 1, 9]), device)
    copies.copy_stream(device).synchronize()
    assert t.device.type == "cuda" and t.dtype == torch.int64 and t.cpu().tolist() == [5, 1, 9]


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "resliced"])
def test_device_state_gather_scatter_equals_the_cpu_result(sliced):
    """State items (transfer.state_pools) through staging on the device: a
    Mamba-like slot state, whole or resliced from prefill rank 1 of 2 into
    decode rank 0 of 1 (three conv sub-blocks), as on the CPU."""
    from bootstrap.messages import StateBuffer
    from transfer.state_pools import StatePool, state_rows
    from transfer.state_slices import row_blocks

    out = {}
    for device in ("cpu", "cuda"):
        g = torch.Generator().manual_seed(5)
        src = StatePool("mamba", [torch.randint(0, 255, (8, 8, 3), dtype=torch.uint8, generator=g).to(device)])
        dst = StatePool("mamba", [torch.zeros((9, 16 if sliced else 8, 3), dtype=torch.uint8, device=device)])
        s_buf = StateBuffer(addr=1, item_bytes=24, num_items=8, slice_dim=8, slice_groups=(4, 4, 8))
        d_buf = StateBuffer(addr=1, item_bytes=48 if sliced else 24, num_items=9, slice_dim=16 if sliced else 8,
                            slice_groups=(4, 4, 8))
        blocks = (row_blocks(s_buf, d_buf, 1, 2, 0, 1 if sliced else 2, first_sender=False),)
        staging = torch.zeros(4096, dtype=torch.uint8, device=device)
        copies.gather_state(staging, 0, state_rows(src), copies.page_tensor(np.array([5, 2]), staging.device), blocks)
        copies.scatter_state(staging, 0, state_rows(dst), copies.page_tensor(np.array([7, 0]), staging.device), blocks)
        out[device] = (dst.buffers[0].cpu().numpy().tobytes(), staging.cpu().numpy().tobytes())
    assert out["cuda"] == out["cpu"]
