"""MHA page transfer between separate prefill and decode processes through
the real Mooncake engine (TCP, loopback), checked byte for byte."""

import pytest

from harness.launch import BootstrapProcess, run_pd
from harness.workload import PoolSpec, Spec

from tests.e2e.conftest import assert_all_succeeded
from tests.e2e.ranks import Rank, assert_all_success, fault_spec

pytestmark = pytest.mark.e2e

MHA = PoolSpec(num_layers=4, total_heads=8, head_dim=128, dtype="bfloat16")


@pytest.fixture
def unfenced(monkeypatch):
    """Direct writes into decode's pools (``write_fence`` off), for the tests
    that count direct descriptors and the aux row's write; the fenced path
    has its own tests (test_faults.py, tests/unit/test_rooms_fence.py)."""
    monkeypatch.setenv("KVFERRY_WRITE_FENCE", "0")


@pytest.mark.parametrize("fence", [False, True], ids=["unfenced", "fenced"])
def test_chunked_sends_scattered_pages_byte_exact(monkeypatch, fence):
    monkeypatch.setenv("KVFERRY_WRITE_FENCE", "1" if fence else "0")
    spec = Spec(bootstrap="", prefill_pools=(MHA,), decode_pools=(MHA,), num_rooms=12, concurrency=4,
                chunk_pages=7, min_tokens=100, max_tokens=2048, page_placement="scattered", seed=11)
    runs = run_pd(spec, timeout_s=180)
    assert_all_succeeded(runs, 12)
    prefill = next(r.result for r in runs if r.role == "prefill")
    decode = next(r.result for r in runs if r.role == "decode")
    # Prefill wrote exactly the bytes decode verified, plus one aux row per
    # room (fenced: the aux row travels in the room's final control message).
    assert prefill["bytes"] == decode["bytes"] + (0 if fence else 12 * spec.aux_slot_bytes)


MLA = PoolSpec(attention="mla", num_layers=3, total_heads=1, head_dim=576, dtype="bfloat16")


@pytest.mark.parametrize("target", ["mha", "mla"])
@pytest.mark.parametrize("fence,staging", [(False, None), (True, None), (True, 4 << 20)],
                         ids=["unfenced", "fenced", "fenced-small-staging"])
def test_layer_wise_sends_byte_exact(monkeypatch, fence, staging, target):
    """Every chunk sent as 3 layer groups (the last layers first) over a
    target (MHA or MLA) and a draft pool: decode verifies every byte, and
    prefill wrote each layer once. Unfenced, the pages go direct, group by
    group; the fenced decode takes each group through its staging and
    scatters it from there as it lands: in the region it granted the room
    with its request or, with 4 MiB of staging (smaller than most rooms
    here), in regions each share asks for."""
    monkeypatch.setenv("KVFERRY_WRITE_FENCE", "1" if fence else "0")
    if staging is not None:
        monkeypatch.setenv("KVFERRY_STAGING_BYTES", str(staging))
        monkeypatch.setenv("KVFERRY_STAGE_PART_BYTES", str(staging // 4))
    monkeypatch.setenv("KVFERRY_STAGE_BELOW_BYTES", "0")  # unfenced: direct descriptors, however small
    monkeypatch.setenv("KVFERRY_LAYERWISE_MIN_TOKENS", "0")  # these prompts are short: stream them anyway
    draft = PoolSpec(role="draft", num_layers=1, total_heads=8, head_dim=64, dtype="bfloat16")
    pools = (MHA if target == "mha" else MLA, draft)
    spec = Spec(bootstrap="", prefill_pools=pools, decode_pools=pools, num_rooms=8, concurrency=4,
                chunk_pages=6, layer_groups=3, min_tokens=100, max_tokens=1500, page_placement="scattered", seed=13)
    runs = run_pd(spec, timeout_s=180)
    assert_all_succeeded(runs, 8)
    prefill = next(r.result for r in runs if r.role == "prefill")
    decode = next(r.result for r in runs if r.role == "decode")
    assert prefill["bytes"] == decode["bytes"] + (0 if fence else 8 * spec.aux_slot_bytes)


def test_contiguous_pages_go_as_one_descriptor_per_buffer(unfenced):
    rooms, layers = 4, MHA.num_layers
    spec = Spec(bootstrap="", prefill_pools=(MHA,), decode_pools=(MHA,), num_rooms=rooms, concurrency=2,
                min_tokens=1000, max_tokens=1024, page_placement="contiguous", prefill_pages=128,
                decode_pages=160, seed=5)
    runs = run_pd(spec, timeout_s=120)
    assert_all_succeeded(runs, rooms)
    prefill = next(r.result for r in runs if r.role == "prefill")
    # One descriptor per (layer, K/V) per room, plus the aux row.
    assert prefill["descriptors"] == rooms * (2 * layers + 1)


def test_64_concurrent_requests_random_pages():
    pool = PoolSpec(num_layers=2, total_heads=4, head_dim=64, dtype="float16")
    spec = Spec(bootstrap="", prefill_pools=(pool,), decode_pools=(pool,), num_rooms=64, concurrency=64,
                min_tokens=16, max_tokens=512, prefill_pages=256, decode_pages=64 * 32 + 8, aux_slots=128,
                chunk_pages=5, seed=64)
    runs = run_pd(spec, timeout_s=240)
    assert_all_succeeded(runs, 64)


@pytest.mark.parametrize("field,decode_pool,extra", [
    ("target.head_dim", PoolSpec(num_layers=4, total_heads=8, head_dim=64), {}),
    ("target.dtype", PoolSpec(num_layers=4, total_heads=8, head_dim=128, dtype="float16"), {}),
    ("target.num_layers", PoolSpec(num_layers=3, total_heads=8, head_dim=128), {}),
    ("target.page_size", MHA, {"decode_page_size": 32}),
])
def test_layout_mismatch_fails_both_sides_naming_the_field(field, decode_pool, extra):
    spec = Spec(bootstrap="", prefill_pools=(MHA,), decode_pools=(decode_pool,), num_rooms=2, concurrency=2,
                max_tokens=512, timeout_s=30, **extra)
    runs = run_pd(spec, timeout_s=90)
    for run in runs:
        assert run.result is not None, run.log[-2000:]
        assert run.returncode != 0
        assert run.result["success"] == 0 and len(run.result["failed"]) == 2, run.result
        for _room, why in run.result["failed"]:
            assert f"incompatible {field}" in why, (run.role, why)
    decode_why = next(r.result["failed"][0][1] for r in runs if r.role == "decode")
    assert decode_why.startswith("IncompatibleLayoutError"), decode_why


def test_several_aux_regions_per_slot_byte_exact():
    """Five aux regions of different row sizes sharing one slot index (as
    SGLang's metadata buffers): every region's row of every room lands, each
    checked byte for byte by the decode rank (``harness.rankctl``)."""
    with BootstrapProcess() as server:
        spec = fault_spec(server.address, aux_regions=(64, 8, 520, 4, 4096), min_tokens=300, max_tokens=1200,
                          chunk_pages=5)
        prefill, decode = Rank("prefill", spec), Rank("decode", spec)
        try:
            rooms = list(range(10, 18))
            prefill.send(op="rooms", rooms=rooms, timeout_s=90)
            decode.send(op="rooms", rooms=rooms, timeout_s=90)
            p, d = prefill.reply(120), decode.reply(120)
            assert_all_success(p, rooms)
            assert_all_success(d, rooms)
        finally:
            prefill.close()
            decode.close()
