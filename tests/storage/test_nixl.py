"""The NIXL store beyond the shared contract: its files, batching into one
transfer, registrations, backend selection and fallback, time bounds, GDS.

Everything runs through the real NIXL agent (POSIX backend here; GDS where a
GPU with cuFile is present) and compares bytes.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import random
import time
from pathlib import Path

import pytest

from transfer.errors import StorageTimeoutError, StorageUnavailableError
from transfer.pools import MHAPool
from transfer.storage.base import open_storage
from transfer.storage.nixl.probe import gds_unavailable_reason, nixl_missing_reason
from transfer.storage.nixl.store import NixlStore
from transfer.storage.segments import pages_segments, pool_regions

from .test_conformance import page_bytes_of, random_mha
from .test_file_store import Buffers

NIXL_MISSING = nixl_missing_reason()
pytestmark = pytest.mark.skipif(bool(NIXL_MISSING), reason=f"nixl backend: {NIXL_MISSING}")

HEADER_BYTES = 4096


def store_at(tmp_path: Path, **options) -> NixlStore:
    options.setdefault("backend", "POSIX")
    return open_storage(f"nixl://{tmp_path / 'store'}", **options)


def key_path(tmp_path: Path, key: str) -> Path:
    return tmp_path / "store" / key[:2] / key


class Spy:
    """Counts the calls of one method of the store's NIXL agent."""

    def __init__(self, monkeypatch, store: NixlStore, name: str) -> None:
        agent = store._agent._agent
        real = getattr(agent, name)
        self.calls: list[tuple] = []

        def spy(*args, **kwargs):
            self.calls.append(args)
            return real(*args, **kwargs)
        monkeypatch.setattr(agent, name, spy)


def test_files_hold_a_4k_header_and_the_payload(tmp_path):
    store = store_at(tmp_path)
    src = Buffers(100, 28, 4000, seed=1)
    assert store.put(["abc123"], [src.segments]) == [True]
    data = key_path(tmp_path, "abc123").read_bytes()
    assert len(data) == HEADER_BYTES + 4128 and data[:8] == b"KVFNIXL1" and data[HEADER_BYTES:] == src.value
    assert not [p for p in (tmp_path / "store").rglob(".*")], "no temporary file left behind"
    assert store.backend == "POSIX"


def test_a_batch_is_one_nixl_transfer_and_large_batches_are_cut(tmp_path, monkeypatch):
    store = store_at(tmp_path)
    src, dst = random_mha(80, 30, layers=2), random_mha(80, 31, layers=2)  # 4 segments per page
    rng = random.Random(32)
    pages = rng.sample(range(80), 64)
    keys = [f"k{i:03d}" for i in range(64)]
    spy = Spy(monkeypatch, store, "initialize_xfer")
    assert store.put(keys, pages_segments(src, pages)) == [True] * 64
    assert len(spy.calls) == 1 and spy.calls[0][0] == "WRITE"
    assert store.get_into(keys[::-1], pages_segments(dst, pages)) == [True] * 64
    assert len(spy.calls) == 2 and spy.calls[1][0] == "READ"
    for i, page in enumerate(pages):
        assert page_bytes_of(dst, page) == page_bytes_of(src, pages[63 - i])
    store.close()
    small = store_at(tmp_path, max_descs_per_xfer=10)  # 2 pages a transfer
    spy = Spy(monkeypatch, small, "initialize_xfer")
    assert small.get_into(keys, pages_segments(dst, pages)) == [True] * 64
    assert len(spy.calls) == 32


def test_a_failed_batch_is_retried_key_by_key(tmp_path, monkeypatch):
    store = store_at(tmp_path)
    src = [Buffers(3000, 1000, seed=40 + i) for i in range(5)]
    keys = [f"r{i}" for i in range(5)]
    assert store.put(keys, [b.segments for b in src]) == [True] * 5
    real_open = store._open_value

    def open_value(entry):  # r2's file is cut short after its checks passed: NIXL's read of it fails
        real_open(entry)
        if entry.key == "r2":
            os.truncate(key_path(tmp_path, "r2"), HEADER_BYTES + 100)
    monkeypatch.setattr(store, "_open_value", open_value)
    spy = Spy(monkeypatch, store, "initialize_xfer")
    dst = [Buffers(3000, 1000, seed=50 + i) for i in range(5)]
    assert store.get_into(keys, [b.segments for b in dst]) == [True, True, False, True, True]
    assert [d.value == s.value for d, s in zip(dst, src)] == [True, True, False, True, True]
    assert len(spy.calls) == 1 + 5  # the batch, then each key alone
    monkeypatch.undo()
    assert store.get_into(["r2"], [dst[2].segments]) == [False]  # now found short before reading, and deleted
    assert store.exists(keys) == 2 and store.exists(keys[3:]) == 2


def flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 1]) + data[offset + 1:]


DAMAGES = {
    "flip a payload byte": lambda data: flip(data, HEADER_BYTES + 70),
    "foreign magic": lambda data: b"KVFERRY1" + data[8:],
    "another format version": lambda data: data[:8] + b"\x09\x00" + data[10:],
    "shorter than the header says": lambda data: data[:-1],
    "longer than the header says": lambda data: data + b"x",
    "shorter than the header block": lambda data: data[:100],
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_file_is_a_miss_and_is_deleted(tmp_path, damage):
    store = store_at(tmp_path)
    src, dst = Buffers(64, 64, seed=2), Buffers(64, 64, seed=3)
    assert store.put(["k1"], [src.segments]) == [True]
    path = key_path(tmp_path, "k1")
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    untouched = dst.value
    assert store.get_into(["k1"], [dst.segments]) == [False]
    assert not path.exists() and store.exists(["k1"]) == 0
    # only a checksum mismatch is found after the read; every other damage before it
    assert (dst.value == untouched) == (damage != "flip a payload byte")


def test_without_checksums_a_flipped_byte_is_read_as_is(tmp_path):
    store = store_at(tmp_path, checksum=False)
    src = Buffers(128, seed=4)
    assert store.put(["k1"], [src.segments]) == [True]
    path = key_path(tmp_path, "k1")
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 5] ^= 0x01
    path.write_bytes(bytes(data))
    dst = Buffers(128, seed=5)
    assert store.get_into(["k1"], [dst.segments]) == [True]
    assert dst.value[5] == src.value[5] ^ 0x01 and dst.value[6:] == src.value[6:]


def test_registered_pools_are_registered_once_and_not_per_call(tmp_path, monkeypatch):
    store = store_at(tmp_path)
    src, dst = random_mha(20, 60), random_mha(20, 61)
    store.register_memory(pool_regions(src))
    store.register_memory(pool_regions(src))  # idempotent
    store.register_memory(pool_regions(dst))
    assert len(store._registered) == 2 * len(pool_regions(src))
    calls = []
    real_register = store._agent.register

    def register(regions=(), files=()):
        calls.append((list(regions), list(files)))
        real_register(regions=regions, files=files)
    monkeypatch.setattr(store._agent, "register", register)
    keys = [f"p{i}" for i in range(20)]
    assert store.put(keys, pages_segments(src, range(20))) == [True] * 20
    assert store.get_into(keys, pages_segments(dst, range(20)[::-1])) == [True] * 20
    assert all(page_bytes_of(dst, 19 - i) == page_bytes_of(src, i) for i in range(20))
    assert [len(files) for regions, files in calls if files] == [20, 20]  # each call: its files only
    assert not [regions for regions, files in calls if regions]  # no memory registered per call
    unregistered = random_mha(2, 62)
    assert store.put(["u"], pages_segments(unregistered, [1])) == [True]  # registered for this call only
    assert [len(regions) for regions, files in calls if regions] == [len(pool_regions(unregistered))]
    assert len(store._registered) == 2 * len(pool_regions(src))


def test_segments_across_a_registered_region_and_beyond_still_move(tmp_path):
    store = store_at(tmp_path)
    buf = Buffers(8192, seed=7)
    (addr, nbytes), = buf.segments
    store.register_memory([(addr, 4096)])  # half of the buffer
    store.register_memory([(addr + 1000, 1000)])  # inside: nothing new
    assert list(store._registered) == [(addr, 4096)]
    assert store.put(["whole"], [[(addr, nbytes)]]) == [True]  # lifts the half, registers the whole for the call
    assert list(store._registered) == [(addr, 4096)]  # and puts the half back
    dst = Buffers(8192, seed=8)
    assert store.get_into(["whole"], [dst.segments]) == [True] and dst.value == buf.value
    store.register_memory([(addr + 2048, 6144)])  # overlaps: replaced by the union
    assert list(store._registered) == [(addr, 8192)]


def test_direct_io_moves_aligned_pages_and_refuses_unaligned_ones(tmp_path):
    store = store_at(tmp_path, direct_io=True)
    src, dst = mmap.mmap(-1, 6 * 4096), mmap.mmap(-1, 6 * 4096)  # page-aligned host memory
    src[:] = random.Random(9).randbytes(len(src))
    src_addr = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst_addr = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    segments = [[(src_addr + 4096 * 4, 8192), (src_addr, 4096)], [(src_addr + 4096, 3 * 4096)]]
    assert store.put(["d0", "d1"], segments) == [True, True]
    assert store.get_into(["d1", "d0"], [[(dst_addr, 3 * 4096)], [(dst_addr + 3 * 4096, 3 * 4096)]]) == [True, True]
    assert dst[:3 * 4096] == src[4096:4 * 4096]
    assert dst[3 * 4096:] == src[4 * 4096:6 * 4096] + src[:4096]
    with pytest.raises(ValueError, match="direct_io"):
        store.put(["d2"], [[(src_addr + 512, 4096)]])
    with pytest.raises(ValueError, match="direct_io"):
        store.get_into(["d0"], [[(dst_addr, 1000)]])


def test_least_recently_used_files_are_evicted_under_the_cap(tmp_path):
    value_bytes = 1000
    store = store_at(tmp_path, max_bytes=3 * (HEADER_BYTES + value_bytes) + 10)
    bufs = {k: Buffers(value_bytes, seed=i) for i, k in enumerate("abcd")}
    for k in "abc":
        assert store.put([k + "0"], [bufs[k].segments]) == [True]
    scratch = Buffers(value_bytes)
    assert store.get_into(["a0"], [scratch.segments]) == [True]  # a is now the most recent
    assert store.put(["d0"], [bufs["d"].segments]) == [True]  # evicts b
    assert [store.exists([k + "0"]) for k in "abcd"] == [1, 0, 1, 1]
    assert store.total_bytes == 3 * (HEADER_BYTES + value_bytes)
    store.close()
    reopened = store_at(tmp_path, max_bytes=2 * (HEADER_BYTES + value_bytes))
    assert reopened.total_bytes == 2 * (HEADER_BYTES + value_bytes)
    one_byte = Buffers(1)
    assert store_at(tmp_path, max_bytes="4KiB").put(["big"], [one_byte.segments]) == [False]  # over the cap


def test_a_transfer_past_its_deadline_is_cancelled_and_raises(tmp_path, monkeypatch):
    store = store_at(tmp_path, xfer_timeout_s=0.3)
    src = Buffers(4096, seed=11)
    agent = store._agent._agent
    monkeypatch.setattr(agent, "transfer", lambda handle, notif_msg=b"": "PROC")  # never posted, never done
    monkeypatch.setattr(agent, "check_xfer_state", lambda handle: "PROC")
    start = time.monotonic()
    with pytest.raises(StorageTimeoutError, match="did not finish in time"):
        store.put(["slow"], [src.segments])
    assert 0.3 <= time.monotonic() - start < 5
    assert store.exists(["slow"]) == 0
    assert not [p for p in (tmp_path / "store").rglob(".*")], "the temporary file is removed"
    monkeypatch.undo()
    assert store.put(["slow"], [src.segments]) == [True], "the store still works after a cancelled transfer"


def test_a_transfer_that_cannot_be_cancelled_stops_the_store(tmp_path, monkeypatch):
    store = store_at(tmp_path, xfer_timeout_s=0.2)
    src = Buffers(4096, seed=12)
    agent = store._agent._agent
    monkeypatch.setattr(agent, "check_xfer_state", lambda handle: "PROC")

    def release(handle):
        raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
    monkeypatch.setattr(agent, "release_xfer_handle", release)
    with pytest.raises(StorageTimeoutError, match="could not be cancelled"):
        store.put(["stuck"], [src.segments])
    with pytest.raises(StorageUnavailableError, match="could not be cancelled"):
        store.exists(["stuck"])
    store.close()


def test_gds_asked_for_here_is_a_clear_error(tmp_path):
    why = gds_unavailable_reason("GDS")
    if not why:
        pytest.skip("GDS works on this machine: nothing to fall back from")
    with pytest.raises(StorageUnavailableError) as info:
        store_at(tmp_path, backend="GDS")
    message = str(info.value)
    assert "GDS backend is not available here" in message and why in message and "allow_fallback=1" in message


def test_gds_with_fallback_allowed_uses_posix_and_warns_why(tmp_path, caplog):
    why = gds_unavailable_reason("GDS_MT")
    if not why:
        pytest.skip("GDS works on this machine: nothing to fall back from")
    with caplog.at_level(logging.WARNING, logger="kvferry.storage.nixl"):
        store = open_storage(f"nixl://{tmp_path / 'store'}?backend=GDS_MT&allow_fallback=1")
    assert store.backend == "POSIX"
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvferry.storage.nixl"]
    assert any("GDS_MT backend is not available here" in w and why in w and "POSIX" in w for w in warnings)
    src, dst = Buffers(5000, 123, seed=13), Buffers(5000, 123, seed=14)
    assert store.put(["f"], [src.segments]) == [True]
    assert store.get_into(["f"], [dst.segments]) == [True] and dst.value == src.value
    with pytest.raises(StorageUnavailableError, match="no fallback for GPU memory"):
        store_at(tmp_path, backend="GDS", allow_fallback=True, memory="VRAM")


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="POSIX backend cannot reach GPU memory"):
        store_at(tmp_path, memory="VRAM")
    with pytest.raises(ValueError, match="backend must be"):
        store_at(tmp_path, backend="UCX")
    with pytest.raises(ValueError, match="unknown option"):
        store_at(tmp_path, bogus=1)
    with pytest.raises(ValueError, match="needs a directory"):
        open_storage("nixl://")


@pytest.mark.parametrize("backend", ["GDS", "GDS_MT"])
def test_gds_moves_pages_between_gpu_memory_and_files(tmp_path, backend):
    """Runs where a GPU with cuFile is present: random pages of a pool on the
    GPU (host memory when torch has no CUDA) through GDS and back."""
    torch = pytest.importorskip("torch")
    memory = "VRAM" if torch.cuda.is_available() else "DRAM"
    why = gds_unavailable_reason(backend, memory)
    if why:
        pytest.skip(f"NIXL {backend} is not available here: {why}")
    device = "cuda" if memory == "VRAM" else "cpu"
    src, dst = (random_mha(64, seed, layers=4) for seed in (70, 71))
    src, dst = (MHAPool(k=[t.to(device) for t in pool.k], v=[t.to(device) for t in pool.v]) for pool in (src, dst))
    device_id = torch.cuda.current_device() if device == "cuda" else 0
    store = store_at(tmp_path, backend=backend, memory=memory, device_id=device_id)
    assert store.backend == backend
    store.register_memory(pool_regions(src))
    store.register_memory(pool_regions(dst))
    rng = random.Random(72)
    src_pages, dst_pages = rng.sample(range(64), 32), rng.sample(range(64), 32)
    keys = [f"g{i}" for i in range(32)]
    assert store.put(keys, pages_segments(src, src_pages)) == [True] * 32
    assert store.get_into(keys, pages_segments(dst, dst_pages)) == [True] * 32
    if device == "cuda":
        torch.cuda.synchronize()
    for s, d in zip(src_pages, dst_pages):
        assert all(torch.equal(a[d].cpu().view(torch.uint8), b[s].cpu().view(torch.uint8))
                   for a, b in zip(dst.k + dst.v, src.k + src.v))
    store.close()
