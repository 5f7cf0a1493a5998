"""SGLang's own code drives kvferry across real processes (``make test-sglang``).

Each run starts kvferry's bootstrap server through SGLang's class lookup,
prefill and decode ranks that build SGLang's pools, ``KVArgs`` and
``MetadataBuffers`` as its schedulers do, and follow its call sequence (see
``rank.py``); the requests are in ``scenarios.py``. Every page and every aux
region is compared byte for byte on decode against the data prefill wrote.
"""

from __future__ import annotations

import argparse

import pytest

from tests.engines.sglang.procs import Run
from tests.engines.sglang.scenarios import PAGE_SIZE, requests_of

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def sglang():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.disaggregation.utils as utils

    return utils


def test_the_plugin_selects_kvferry_with_no_sglang_change(sglang):
    from sglang.srt.server_args import ServerArgs

    from transfer.adapters.sglang.bootstrap import KvferryKVBootstrapServer
    from transfer.adapters.sglang.manager import KvferryKVManager
    from transfer.adapters.sglang.receiver import KvferryKVReceiver
    from transfer.adapters.sglang.sender import KvferryKVSender

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--disaggregation-mode", "prefill",
                              "--disaggregation-transfer-backend", "kvferry"])
    backend = sglang.TransferBackend(ServerArgs.from_cli_args(args).disaggregation_transfer_backend)
    kinds = sglang.KVClassType
    assert sglang.get_kv_class(backend, kinds.MANAGER) is KvferryKVManager
    assert sglang.get_kv_class(backend, kinds.SENDER) is KvferryKVSender
    assert sglang.get_kv_class(backend, kinds.RECEIVER) is KvferryKVReceiver
    assert sglang.get_kv_class(backend, kinds.BOOTSTRAP_SERVER) is KvferryKVBootstrapServer
    assert sglang.get_kv_class(sglang.TransferBackend.FAKE, kinds.MANAGER).__name__ == "FakeKVManager"
    with pytest.raises(SystemExit):  # an unknown backend is still refused by SGLang's parser
        parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "nope"])


@pytest.mark.parametrize("change, words", [
    (dict(state_types=["dsa_tail"], state_data_ptrs=[[1]]), "state pools of type dsa_tail"),
    (dict(pp_size=2), "pipeline parallelism"),
    (dict(attn_cp_size=2), "context parallelism"),
])
def test_unsupported_setups_are_refused_at_start_up(sglang, change, words):
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import KVArgs, StateType

    from transfer.adapters.sglang.kvargs import UnsupportedSetup
    from transfer.adapters.sglang.manager import KvferryKVManager

    kv_args = KVArgs()
    kv_args.state_types = [StateType(s) for s in change.get("state_types", [])]
    kv_args.state_data_ptrs = change.get("state_data_ptrs", [])
    server_args = SimpleNamespace(pp_size=change.get("pp_size", 1), attn_cp_size=change.get("attn_cp_size", 1),
                                  **{k: change[k] for k in ("disaggregation_mode", "dp_size", "load_balance_method")
                                     if k in change})
    with pytest.raises(UnsupportedSetup, match="unsupported SGLang set-up") as info:
        KvferryKVManager(kv_args, sglang.DisaggregationMode.PREFILL, server_args, False)
    assert words in str(info.value)


def _results(procs) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for p in procs:
        for r in p.events("RESULT"):
            out.setdefault(r["room"], []).append(r)
    return out


def _check_main(run: Run, *, state: bool = False, page_size: int = PAGE_SIZE) -> None:
    run.finish()
    decode, prefill = _results(run.decode), _results(run.prefill)
    assert all(not p.events("DONE")[0]["timed_out"] for p in run.prefill + run.decode)
    for req, d in ((r, d) for r in requests_of("main") for d in decode[r.room]):  # every decode rank's
        ps = prefill[req.room]
        assert len(decode[req.room]) == run.decode_tp // run.decode_dp  # the ranks of the room's decode DP group
        assert len(ps) == run.prefill_tp // run.prefill_dp  # the ranks of the room's prefill DP group
        if req.action:
            assert d["state"] == "Failed", (req.tags, d)
            assert all(p["state"] == "Failed" for p in ps), (req.tags, ps)
            # kvferry's room on every prefill rank failed too (not left waiting for a timeout)
            assert all(p["core_state"] == "Failed" for p in ps if p["core_state"] is not None), (req.tags, ps)
            assert d["written_after_failure"] == 0 and d["release_safe"], (req.tags, d)
            # SGLang fails a room on every TP rank once one rank failed it (a MIN over the ranks): a rank
            # may report that, the room's own cause reaching at least one rank.
            cause = "aborted by the decode scheduler" if req.action.startswith("decode_abort") else \
                "aborted by the prefill scheduler"
            assert cause in d["error"] or "failed on another rank" in d["error"], (req.tags, d)
            assert any(cause in e["error"] for e in decode[req.room]), (req.tags, decode[req.room])
            if req.action.startswith("decode_abort"):
                assert d["pages_untouched"], (req.tags, d)
            continue
        assert d["state"] == "Success" and all(p["state"] == "Success" for p in ps), (req.tags, d, ps)
        assert (d["bad_page_bytes"], d["bad_prefix_bytes"], d["bad_aux_bytes"], d["bad_state_bytes"]) == \
            (0, 0, 0, 0), (req.tags, d)
        assert (d["state_bytes_checked"] > 0) == state, (req.tags, d)
        assert d["aux_regions"] >= 10
        suffix = req.num_pages - req.prefix_pages
        assert (d["page_bytes_checked"] > 0) == (suffix > 0), (req.tags, d)
        # per-room stats: pages moved (this rank's share) plus, from one rank, the aux rows
        assert sum(p["bytes"] for p in ps) >= d["page_bytes_checked"] and all(p["latency_s"] > 0 for p in ps)
        if suffix > 0:  # (with the write fence on, decode's default, the aux row alone travels in RoomStatus)
            assert sum(p["descriptors"] for p in ps) >= 1
    prefixes = {e["room"]: e["tokens"] for p in run.prefill for e in p.events("PREFIX")}
    for req in requests_of("main"):
        if not req.action.startswith("decode_abort") and req.room in prefixes:
            assert prefixes[req.room] == req.prefix_pages * page_size


def test_mha_with_draft_prefill_tp2_to_decode_tp1_staged():
    with Run("main", pool="mha", draft=True, prefill_tp=2, timeout_s=150) as run:
        _check_main(run)


@pytest.mark.parametrize("method", ["auto", "round_robin"])
def test_attention_dp2_on_both_sides_routes_each_room_to_its_prefill_dp_rank(method):
    """SGLang's DP attention: prefill TP 2 as two DP groups of one rank, decode
    likewise. Under follow_bootstrap_room (``auto``, SGLang's PD prefill
    default) a room sits on prefill DP rank room % 2, and decode asks that
    rank; under round_robin the prefill's DP controller puts it elsewhere
    (here on the other rank), the prefill's senders register each room's DP
    rank with the bootstrap port's registry, and SGLang's decode asks it
    over HTTP (``/query_dp_ranks``, SGLang's own code). Decode learns the
    prefill's method at the bootstrap lookup; every room lands exact."""
    with Run("main", pool="mha", prefill_tp=2, prefill_dp=2, decode_tp=2, decode_dp=2, timeout_s=150,
             extra_args=["--load-balance", method]) as run:
        _check_main(run)
        follows = method == "auto"
        for p in run.prefill:  # each DP rank served the rooms of its own residue, and only those
            ready = p.events("READY")[0]
            served = {r["room"] for r in p.events("RESULT")}
            assert served == set(ready["rooms"]) and served, ready
            assert all((room % 2 == ready["dp_rank"]) == follows for room in served), ready
        assert {(e["prefill_dp"], e["follow_bootstrap_room"]) for d in run.decode for e in d.events("READY")} == \
            {(2, follows)}


def test_mha_prefill_tp1_to_decode_tp2_each_decode_rank_gets_its_heads():
    """Decode TP > prefill TP: the one prefill rank sends each decode rank its half of the heads."""
    with Run("main", pool="mha", prefill_tp=1, decode_tp=2, timeout_s=150,
             env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1"}) as run:
        _check_main(run)  # each decode rank's pages (its half of the heads) byte for byte


def test_mla_prefill_tp2_to_decode_tp1_direct_descriptors():
    """MLA is the same on every prefill rank: one sends, the other only concludes."""
    with Run("main", pool="mla", prefill_tp=2, env={"KVFERRY_STAGING_BYTES": "0"}, timeout_s=150) as run:
        _check_main(run)
        senders = [sum(r["bytes"] > 0 for r in p.events("RESULT") if r["state"] == "Success") for p in run.prefill]
        assert sorted(senders)[0] == 0 and sorted(senders)[1] > 0, senders


@pytest.mark.parametrize("state, prefill_tp, decode_tp, fence", [
    ("swa", 1, 1, "1"), ("mamba", 2, 2, "0"),
    ("swa", 2, 1, "1"), ("swa", 1, 2, "0"), ("mamba", 2, 1, "1"), ("mamba", 1, 2, "0"),
    ("mxfp8", 1, 1, "1"), ("mxfp8", 2, 1, "0")])
def test_state_built_by_sglang_moves_item_exact(state, prefill_tp, decode_tp, fence):
    """SGLang's own state pools (a sliding-window SWAKVPool; a Mamba2
    hybrid's HybridLinearKVPool over a MambaPool, sharded over the TP ranks;
    an MXFP8 KV pool's block scales, MHATokenToKVPoolMXFP8)
    through its setup_state_kv_args, the state indices SGLang passes to send
    and send_metadata: every room's window pages / Mamba slot land byte-exact
    with the last chunk (the decode prefix, the empty last chunk and the
    aborts of the main scenario included), through the write fence's staging
    (fence 1) and direct (fence 0); at equal TP rank to rank, and between TP
    2 and 1 resliced as SGLang slices them (window pages by KV heads, Mamba
    conv channels and SSM heads): each decode rank holds its share of the
    state the prefill ranks held together."""
    with Run("main", pool="mha", prefill_tp=prefill_tp, decode_tp=decode_tp, timeout_s=150,
             extra_args=["--state", state] + (["--head-dim", "32"] if state == "mxfp8" else []),
             env={"KVFERRY_WRITE_FENCE": fence, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1"}) as run:
        _check_main(run, state=True)


@pytest.mark.parametrize("prefill_tp, decode_tp, fence", [(2, 1, "1"), (2, 1, "0"), (1, 2, "1"), (2, 2, "0")])
def test_dsa_indexer_state_of_an_mla_model_moves_from_one_prefill_rank(prefill_tp, decode_tp, fence):
    """DeepSeek's sparse attention: SGLang's DSATokenToKVPool (MLA latent
    cache plus the indexer's K cache, 64-token pages) through its
    setup_state_kv_args. The latent and the indexer pages are the same on
    every TP rank: at prefill TP 2 -> decode TP 1 one prefill rank sends
    them; at 1 -> 2 the one prefill rank sends each decode rank its copy; at
    2 -> 2 each decode rank gets them from one prefill rank.
    Every room's indexer pages land byte-exact, fenced and direct."""
    with Run("main", pool="mla", prefill_tp=prefill_tp, decode_tp=decode_tp, timeout_s=150,
             extra_args=["--state", "dsa", "--page-size", "64"],
             env={"KVFERRY_WRITE_FENCE": fence, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1"}) as run:
        _check_main(run, state=True, page_size=64)
        if prefill_tp > decode_tp:  # one prefill rank sent each room (the other only concluded)
            senders = [sum(r["bytes"] > 0 for r in p.events("RESULT") if r["state"] == "Success")
                       for p in run.prefill]
            assert sorted(senders)[0] == 0 and sorted(senders)[1] > 0, senders


def test_a_killed_prefill_fails_the_room_and_frees_its_pages_safely():
    with Run("kill", pool="mha", timeout_s=150, env={"KVFERRY_PEER_TIMEOUT_S": "3"}) as run:
        run.prefill[0].wait_for("KILLME", run.timeout_s)
        run.prefill[0].kill()
        done = run.decode[0].wait_for("DONE", 60)
        assert not done["timed_out"]
        (result,) = run.decode[0].events("RESULT")
        assert result["state"] == "Failed" and result["release_safe"]
        # Killed: found by its refused reconnections ("gone"), or by its silence past the timeout.
        assert "gone" in result["error"] or "silent" in result["error"], result
        assert result["written_after_failure"] == 0


def test_the_kv_checksum_row_travels_and_a_corrupted_page_is_caught():
    """``--disaggregation-enable-kv-checksum``: prefill writes the digest of the
    pages it sends and SGLang's layout signature into MetadataBuffers' checksum
    row; kvferry moves the row with the other aux rows, and decode's digest of
    what landed matches it, except for the request whose landed page decode
    flipped a byte of. (SGLang's digest kernel is CUDA only: both sides take
    the same Adler-32 on the CPU, see ``sglang_rank.Rank.digest``.)"""
    with Run("checksum", pool="mha", timeout_s=120, extra_args=["--kv-checksum"]) as run:
        run.finish()
        decode = _results(run.decode)
        for req in requests_of("checksum"):
            (d,) = decode[req.room]
            assert d["state"] == "Success", (req.tags, d)
            assert (d["bad_page_bytes"], d["bad_prefix_bytes"], d["bad_aux_bytes"]) == (0, 0, 0), (req.tags, d)
            assert d["checksum_sent"] and d["checksum_comparable"] and d["verify_checksum"], (req.tags, d)
            assert d["checksum_matches"] is (not req.corrupt), (req.tags, d)


def test_an_early_send_reads_the_pages_only_once_sglangs_event_says_they_are_written():
    """SGLang's prefill hands the sender ``_early_send_wait_event`` before an
    early send of a cached prefix (the previous step's forward may still be
    writing those pages): the first chunk's pages hold zeros until, 0.5 s
    after send(), the event's writer puts their KV there; decode's pages must
    hold that KV, byte for byte (they held the zeros when the sender dropped
    the event)."""
    with Run("early", pool="mha", timeout_s=120) as run:
        run.finish()
        decode = _results(run.decode)
        for req in requests_of("early"):
            (d,) = decode[req.room]
            assert d["state"] == "Success", (req.tags, d)
            assert d["page_bytes_checked"] > 0 and d["bad_page_bytes"] == 0, (req.tags, d)


def test_memory_release_fails_the_room_in_flight_and_a_room_after_resume_lands_exact():
    """SGLang's release_memory_occupation on decode while a room is in flight
    (prefill sent one chunk and holds the rest): kvferry fails the room on both
    sides before deregister_buffer_to_engine returns, nothing is written into
    its pages afterwards, a room asked for while released fails at once, and
    after resume_memory_occupation the next room lands byte-exact."""
    with Run("release", pool="mha", timeout_s=120) as run:
        run.finish()
        (released,) = run.decode[0].events("RELEASED")
        assert released["in_flight_state"] == 0, released  # KVPoll.Failed, before deregister returned
        assert released["probe_failed"] and "KV memory is released" in released["probe_error"], released
        decode, prefill = _results(run.decode), _results(run.prefill)
        held, later = requests_of("release")
        (d,) = decode[held.room]
        assert d["state"] == "Failed" and "released the KV memory" in d["error"], d
        assert d["written_after_failure"] == 0 and d["release_safe"], d
        assert prefill[held.room][0]["state"] == "Failed", prefill[held.room]
        (d,) = decode[later.room]
        assert d["state"] == "Success", d
        assert (d["bad_page_bytes"], d["bad_prefix_bytes"], d["bad_aux_bytes"]) == (0, 0, 0), d


def _sliding_window_pool():
    import torch
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=64, size_swa=32, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=8,
                     swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1], device="cpu")


def _hybrid_mamba_pool():
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=64, n_groups=1, num_heads=4, head_dim=16,
                                    state_size=8, conv_kernel=4)
    mamba = MambaPool(size=8, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]),
                      mamba_layer_ids=[0, 2], device="cpu")
    return HybridLinearKVPool(size=64, dtype=torch.bfloat16, page_size=4, head_num=2, head_dim=8,
                              full_attention_layer_ids=[1], device="cpu", mamba_pool=mamba)


@pytest.mark.parametrize("build, kind, sharding, exact", [(_sliding_window_pool, "swa", "sharded", False),
                                                         (_hybrid_mamba_pool, "mamba", "sharded", True)])
def test_a_state_pool_built_as_sglang_builds_it_becomes_a_kvferry_state_pool(sglang, build, kind, sharding, exact):
    """SGLang's own pools with state (a sliding-window SWAKVPool; a Mamba
    hybrid's HybridLinearKVPool over a MambaPool) through its own
    ``setup_state_kv_args``: each state component is one kvferry state pool
    over the same memory (no copy), its items SGLang's item sizes."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    from transfer.adapters.sglang.kvargs import check_supported, states_from_kv_args
    from transfer.state_pools import describe_state

    kv_args = KVArgs()
    sglang.setup_state_kv_args(kv_args, build(), None, 3, req_to_token_pool=None)
    assert [s.value for s in kv_args.state_types] == [kind]
    from types import SimpleNamespace

    check_supported(kv_args, SimpleNamespace(pp_size=1))
    (pool,) = states_from_kv_args(kv_args, is_mla=False)
    desc = describe_state(pool)
    assert (desc.kind, desc.sharding.value, desc.exact) == (kind, sharding, exact)
    assert [b.addr for b in desc.buffers] == kv_args.state_data_ptrs[0]
    assert [b.item_bytes for b in desc.buffers] == kv_args.state_item_lens[0]
    assert [b.num_items for b in desc.buffers] == [n // i for n, i in zip(kv_args.state_data_lens[0],
                                                                          kv_args.state_item_lens[0])]


def test_the_bootstrap_port_speaks_sglangs_http_and_names_kvferrys_port(sglang, monkeypatch):
    """The bootstrap port serves SGLang's room registry (its own
    CommonKVReceiver.query_prefill_dp_ranks reads what a prefill registered)
    and GET /kvferry names kvferry's bootstrap server, by default on the
    next port, and the prefill's HTTP port once a rank posted it; a
    malformed request gets 400 and the server keeps serving."""
    import json
    import time
    import urllib.error
    import urllib.request

    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    from tests.engines.sglang.procs import free_ports
    from transfer.adapters.sglang.bootstrap import KvferryKVBootstrapServer, RoomRegistrar, kvferry_address, post

    monkeypatch.delenv("KVFERRY_SGLANG_BOOTSTRAP_PORT", raising=False)
    port = free_ports(2)
    server = KvferryKVBootstrapServer("127.0.0.1", port)
    try:
        addr = f"127.0.0.1:{port}"
        assert kvferry_address(addr, 2.0) == f"127.0.0.1:{port + 1}" == server.server.address
        with pytest.raises(urllib.error.HTTPError, match="400"):
            urllib.request.urlopen(urllib.request.Request(f"http://{addr}/query_dp_ranks", data=b"{", method="POST"),
                                   timeout=2)
        RoomRegistrar(addr, 1).register(7_000_000_000_123)
        assert post(addr, "/register_dp_rank", {"bootstrap_room": 42, "dp_rank": 0})
        for _ in range(50):
            found = CommonKVReceiver.query_prefill_dp_ranks(addr, [42, 7_000_000_000_123, 5])
            if len(found) == 2:
                break
            time.sleep(0.05)
        assert found == {"42": 0, "7000000000123": 1}
        assert post(addr, "/kvferry", {"follow_bootstrap_room": False, "dp_size": 2})
        with urllib.request.urlopen(f"http://{addr}/kvferry", timeout=2) as reply:
            assert json.loads(reply.read()) == {"port": port + 1, "follow_bootstrap_room": False, "dp_size": 2}
        # a prefill rank names its server's HTTP port, where decode posts a PD retract rebootstrap's /generate
        assert post(addr, "/kvferry", {"follow_bootstrap_room": True, "dp_size": 1, "prefill_http_port": 30000})
        with urllib.request.urlopen(f"http://{addr}/kvferry", timeout=2) as reply:
            assert json.loads(reply.read()) == {"port": port + 1, "follow_bootstrap_room": True, "dp_size": 1,
                                                "prefill_http_port": 30000}
    finally:
        server.close()
