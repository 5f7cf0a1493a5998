"""CUDA pools between two processes on one GPU (prefill, decode) through the
CUDA build of Mooncake over TCP: every target/draft mix, heterogeneous TP
2 -> 1 with head slices, staged scattered pages gathered and scattered on
the device, aux rows on the device, and the producer-stream race. Random
data and pages, byte-exact (decode checks every byte on the host)."""

import pytest

from harness.launch import run_pd
from harness.workload import PoolSpec, Spec
from tests.e2e.conftest import assert_all_succeeded

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("cuda_engine")]

MLA_TARGET = PoolSpec(role="target", attention="mla", num_layers=3, total_heads=1, head_dim=576)
MHA_TARGET = PoolSpec(role="target", attention="mha", num_layers=3, total_heads=8, head_dim=64)
MHA_DRAFT = PoolSpec(role="draft", attention="mha", num_layers=1, total_heads=8, head_dim=64)
MLA_DRAFT = PoolSpec(role="draft", attention="mla", num_layers=1, total_heads=1, head_dim=576)
MIXES = {"mla+mha": (MLA_TARGET, MHA_DRAFT), "mla+mla": (MLA_TARGET, MLA_DRAFT),
         "mha+mha": (MHA_TARGET, MHA_DRAFT), "mha+mla": (MHA_TARGET, MLA_DRAFT)}

# Staging on: every chunk of scattered pages goes through the device gather.
STAGED = {"KVFERRY_STAGE_BELOW_BYTES": str(1 << 30), "KVFERRY_STAGING_BYTES": str(16 << 20),
          "KVFERRY_STAGE_PART_BYTES": str(1 << 20)}
DIRECT = {"KVFERRY_STAGING_BYTES": "0"}


def cuda_spec(pools, prefill_tp=1, decode_tp=1, **kw) -> Spec:
    base = dict(bootstrap="", prefill_pools=pools, decode_pools=pools, prefill_tp=prefill_tp, decode_tp=decode_tp,
                num_rooms=4, concurrency=2, min_tokens=40, max_tokens=600, chunk_pages=4, prefill_pages=64,
                decode_pages=128, seed=prefill_tp * 10 + decode_tp, timeout_s=60, device="cuda")
    base.update(kw)
    return Spec(**base)


@pytest.mark.parametrize("path", ["direct", "staged"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_every_mix_moves_between_cuda_pools_byte_exact(mix, path, monkeypatch):
    for key, value in (STAGED if path == "staged" else DIRECT).items():
        monkeypatch.setenv(key, value)
    runs = run_pd(cuda_spec(MIXES[mix]), timeout_s=180, rank_processes=False)
    assert_all_succeeded(runs, 4)


@pytest.mark.parametrize("path", ["direct", "staged"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_prefill_tp2_into_decode_tp1_head_slices(layout, path, monkeypatch):
    for key, value in (STAGED if path == "staged" else DIRECT).items():
        monkeypatch.setenv(key, value)
    target = PoolSpec(role="target", num_layers=2, total_heads=8, head_dim=64, page_layout=layout)
    draft = PoolSpec(role="draft", num_layers=1, total_heads=4, head_dim=32, page_layout=layout)
    runs = run_pd(cuda_spec((target, draft), 2, 1), timeout_s=180, rank_processes=True)
    assert_all_succeeded(runs, 4)
    assert sorted(r.tp_rank for r in runs if r.role == "prefill") == [0, 1]


def test_aux_rows_on_the_device(monkeypatch):
    for key, value in STAGED.items():
        monkeypatch.setenv(key, value)
    runs = run_pd(cuda_spec(MIXES["mha+mha"], aux_device="cuda"), timeout_s=180, rank_processes=False)
    assert_all_succeeded(runs, 4)


def test_contiguous_pages_direct_one_descriptor_per_buffer(monkeypatch):
    for key, value in DIRECT.items():
        monkeypatch.setenv(key, value)
    spec = cuda_spec((MHA_TARGET,), page_placement="contiguous", chunk_pages=0, num_rooms=3)
    runs = run_pd(spec, timeout_s=180, rank_processes=False)
    assert_all_succeeded(runs, 3)


# --- the producer-stream race -----------------------------------------------------------------

# About 0.3-1 s of GPU time per chunk before its pages are written.
SLEEP_CYCLES = 500_000_000


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_a_late_side_stream_write_lands_when_send_gets_its_event(path, monkeypatch):
    for key, value in (STAGED if path == "staged" else DIRECT).items():
        monkeypatch.setenv(key, value)
    spec = cuda_spec((MHA_TARGET,), num_rooms=2, producer_sleep_cycles=SLEEP_CYCLES, pass_ready=True)
    runs = run_pd(spec, timeout_s=240, rank_processes=False)
    assert_all_succeeded(runs, 2)


def test_without_the_event_the_race_is_real(monkeypatch):
    """The control: the same late write, send() without its event. kvferry
    reads the pages before the side stream wrote them; decode sees zeros.
    (If this passes with no mismatch, the race test above proves nothing.)"""
    for key, value in DIRECT.items():
        monkeypatch.setenv(key, value)
    spec = cuda_spec((MHA_TARGET,), num_rooms=2, producer_sleep_cycles=SLEEP_CYCLES, pass_ready=False)
    runs = run_pd(spec, timeout_s=240, rank_processes=False)
    decode = [r.result for r in runs if r.role == "decode"]
    assert decode and all(d is not None for d in decode)
    assert sum(len(d["mismatches"]) for d in decode) > 0, "no mismatch without the event: the race did not happen"


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_layer_groups_each_with_its_own_event_land_when_their_events_complete(path, monkeypatch):
    """Layer-wise sends on the device: each chunk's layers written late, group
    by group, on a side stream, and each group sent with its own CUDA event
    (transfer.rooms.layer_groups); decode checks every byte. Each group goes
    when its event completes: direct, or its share of each part through
    decode's staging (gathered on prefill's copy stream first)."""
    for key, value in (STAGED if path == "staged" else DIRECT).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("KVFERRY_LAYERWISE_MIN_TOKENS", "0")  # short rooms: stream them anyway
    spec = cuda_spec(MIXES["mha+mha"], num_rooms=2, producer_sleep_cycles=SLEEP_CYCLES, pass_ready=True,
                     layer_groups=2)
    runs = run_pd(spec, timeout_s=240, rank_processes=False)
    assert_all_succeeded(runs, 2)
