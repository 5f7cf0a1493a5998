"""Target and draft pools in every MLA/MHA mix, heterogeneous TP, selective
send and DP attention: separate prefill and decode processes, the real
Mooncake engine over TCP loopback, random data and pages, byte-exact."""

import itertools
from dataclasses import replace

import pytest

from harness.launch import BootstrapProcess, run_pd
from harness.workload import PoolSpec, Spec

from tests.e2e.conftest import assert_all_succeeded

pytestmark = pytest.mark.e2e

# DeepSeek-style latent cache (kv_lora_rank 512 + rope 64) and Llama-style GQA heads.
MLA_TARGET = PoolSpec(role="target", attention="mla", num_layers=3, total_heads=1, head_dim=576)
MHA_TARGET = PoolSpec(role="target", attention="mha", num_layers=3, total_heads=8, head_dim=64)
MHA_DRAFT = PoolSpec(role="draft", attention="mha", num_layers=1, total_heads=8, head_dim=64)
MLA_DRAFT = PoolSpec(role="draft", attention="mla", num_layers=1, total_heads=1, head_dim=576)

MIXES = {
    "mla+mha": (MLA_TARGET, MHA_DRAFT),
    "mla+mla": (MLA_TARGET, MLA_DRAFT),
    "mha+mha": (MHA_TARGET, MHA_DRAFT),
    "mha+mla": (MHA_TARGET, MLA_DRAFT),
    "mha": (MHA_TARGET,),
}
TP_PAIRS = [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (8, 2)]


_server: BootstrapProcess | None = None
_node_ids = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def _shared_server():
    """One bootstrap server process for the module's runs (each run had its own)."""
    global _server
    with BootstrapProcess() as server:
        _server = server
        yield
    _server = None


def _run_pd(spec: Spec, **kw):
    """``run_pd`` against the module's bootstrap server, under a prefill node
    name of the run's own: runs never see each other's ranks."""
    return run_pd(replace(spec, node_id=f"prefill-{next(_node_ids)}"), bootstrap=_server.address, **kw)


def small_spec(pools, prefill_tp, decode_tp, **kw) -> Spec:
    base = dict(bootstrap="", prefill_pools=pools, decode_pools=pools, prefill_tp=prefill_tp, decode_tp=decode_tp,
                num_rooms=3, concurrency=3, min_tokens=40, max_tokens=300, chunk_pages=4, prefill_pages=64,
                decode_pages=96, seed=prefill_tp * 10 + decode_tp, timeout_s=60)
    base.update(kw)
    return Spec(**base)


@pytest.mark.parametrize("prefill_tp,decode_tp", TP_PAIRS, ids=[f"p{p}d{d}" for p, d in TP_PAIRS])
@pytest.mark.parametrize("mix", list(MIXES))
def test_mix_by_tp_pair_byte_exact(mix, prefill_tp, decode_tp):
    spec = small_spec(MIXES[mix], prefill_tp, decode_tp)
    runs = _run_pd(spec, timeout_s=120, rank_processes=False)
    assert_all_succeeded(runs, 3)
    assert sorted(r.tp_rank for r in runs if r.role == "prefill") == list(range(prefill_tp))
    assert sorted(r.tp_rank for r in runs if r.role == "decode") == list(range(decode_tp))


@pytest.mark.parametrize("prefill_tp,decode_tp,layout", [(8, 2, "nhd"), (2, 4, "nhd"), (8, 2, "hnd"), (4, 8, "hnd")])
def test_gqa_fewer_kv_heads_than_tp_ranks(prefill_tp, decode_tp, layout):
    # Two KV heads: with TP 4 or 8 each head is replicated on several ranks.
    target = PoolSpec(role="target", num_layers=2, total_heads=2, head_dim=64, page_layout=layout)
    draft = PoolSpec(role="draft", num_layers=1, total_heads=1, head_dim=32, page_layout=layout)
    spec = small_spec((target, draft), prefill_tp, decode_tp)
    runs = _run_pd(spec, timeout_s=120, rank_processes=False)
    assert_all_succeeded(runs, 3)


def test_one_process_per_rank_mla_target_mha_draft():
    spec = small_spec(MIXES["mla+mha"], 2, 4, num_rooms=4)
    runs = _run_pd(spec, timeout_s=120, rank_processes=True)
    assert_all_succeeded(runs, 4)
    assert len({id(r.log) for r in runs}) == 6  # six rank processes


def test_ranks_that_send_nothing_still_end_in_success():
    # MLA target, MHA draft, prefill TP 4 to decode TP 2: one prefill rank per
    # decode rank sends the latent cache, every prefill rank sends its draft
    # heads; an MLA-only pool leaves two prefill ranks with nothing to send.
    runs = _run_pd(small_spec((MLA_TARGET,), 4, 2), timeout_s=120, rank_processes=False)
    assert_all_succeeded(runs, 3)
    prefill = {r.tp_rank: r.result for r in runs if r.role == "prefill"}
    idle = [rank for rank, res in prefill.items() if res["descriptors"] == 0]
    assert idle == [2, 3], {rank: res["descriptors"] for rank, res in prefill.items()}
    assert all(res["success"] == 3 for res in prefill.values())

    runs = _run_pd(small_spec(MIXES["mla+mha"], 4, 2), timeout_s=120, rank_processes=False)
    assert_all_succeeded(runs, 3)
    sent = {r.tp_rank: r.result["bytes"] for r in runs if r.role == "prefill"}
    # ranks 0 and 1 send latent + draft heads, ranks 2 and 3 only their draft heads
    assert sent[0] > sent[2] > 0 and sent[1] > sent[3] > 0, sent


@pytest.mark.parametrize("mix", ["mha", "mla+mha"])
def test_decode_waits_for_every_expected_part(mix):
    # Prefill rank 1 holds back each room's last chunk for 1.5 s. Decode
    # checks every byte the moment it reports Success, so an early Success
    # (before rank 1's part landed) would show as a mismatch.
    spec = small_spec(MIXES[mix], 2, 1, slow_prefill_rank=1, slow_delay_s=1.5, min_tokens=200)
    runs = _run_pd(spec, timeout_s=120, rank_processes=False)
    assert_all_succeeded(runs, 3)
    decode = next(r.result for r in runs if r.role == "decode")
    assert min(decode["latencies_ms"]) >= 1500, decode["latencies_ms"]


@pytest.mark.parametrize("routing", ["auto", "explicit"])
def test_dp_attention_routes_each_room_to_its_group(routing):
    # Two prefill DP groups of TP 2 behind one bootstrap server; each group's
    # pools hold different data, so the byte check proves the routing.
    spec = small_spec(MIXES["mla+mha"], 2, 1, prefill_dp=2, num_rooms=6, dp_routing=routing)
    runs = _run_pd(spec, timeout_s=120, rank_processes=False)
    for r in runs:
        assert r.result is not None and r.result["failed"] == [] and r.result["mismatches"] == [], r.log[-2000:]
    prefill = [r.result for r in runs if r.role == "prefill"]
    assert len(prefill) == 4
    assert sorted((p["dp_rank"], p["success"]) for p in prefill) == [(0, 3), (0, 3), (1, 3), (1, 3)]
    assert next(r.result for r in runs if r.role == "decode")["success"] == 6


def _failures(runs):
    for run in runs:
        assert run.result is not None, run.log[-2000:]
    return {(r.role, r.tp_rank): [why for _, why in r.result["failed"]] for r in runs}


@pytest.mark.parametrize("field,prefill_pools,decode_pools,kw", [
    ("target.page_size", MIXES["mla+mha"], MIXES["mla+mha"], {"decode_page_size": 32}),
    ("draft.dtype", MIXES["mla+mha"], (MLA_TARGET, PoolSpec(role="draft", num_layers=1, total_heads=8,
                                                             head_dim=64, dtype="float16")), {}),
    ("draft pool", (MLA_TARGET,), MIXES["mla+mha"], {}),
    ("target.page_layout", (MHA_TARGET,), (PoolSpec(role="target", num_layers=3, total_heads=8, head_dim=64,
                                                    page_layout="hnd"),), {}),
])
def test_handshake_errors_name_the_field_on_both_sides(field, prefill_pools, decode_pools, kw):
    spec = small_spec(prefill_pools, 2, 1, decode_pools=decode_pools, num_rooms=2, **kw)
    failures = _failures(_run_pd(spec, timeout_s=90, rank_processes=False))
    assert set(failures) == {("prefill", 0), ("prefill", 1), ("decode", 0)}
    for who, whys in failures.items():
        assert len(whys) == 2, (who, whys)
        assert all(f"incompatible {field}" in why for why in whys), (who, whys)


def test_tp_ratio_that_does_not_divide_is_refused():
    pool = PoolSpec(role="target", num_layers=1, total_heads=6, head_dim=32)
    # Prefill's rooms end at the first refusal; it stays registered until
    # every decode rank (slower to start on some transports) looked it up.
    spec = small_spec((pool,), 3, 2, num_rooms=1, prefill_hold_s=5.0)
    failures = _failures(_run_pd(spec, timeout_s=90, rank_processes=False))
    for who, whys in failures.items():
        assert whys and all("incompatible tp_size" in w and "neither divides the other" in w for w in whys), \
            (who, whys)


def test_missing_draft_served_target_only_when_allowed():
    spec = small_spec((MLA_TARGET,), 2, 1, decode_pools=MIXES["mla+mha"], allow_missing_draft=True)
    runs = _run_pd(spec, timeout_s=90, rank_processes=False)
    assert_all_succeeded(runs, 3)
