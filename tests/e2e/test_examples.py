"""The two-node speculative-decoding example: the bootstrap server, two
prefill rank processes and the decode node as separate processes, through
the real Mooncake engine over TCP, on loopback and between two network
namespaces; the decode node's tokens against the single-process run. The
demo's storage step: pages a file store has are not sent again, and a room
whose prefill node was killed is restored from the store."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from examples.node_common import AUX_COLUMNS, make_requests, model_pair, parse_node_args
from examples.paged_kv import RankPools, pages_for
from examples.speculative import reference_tokens
from examples.tiny_models import ModelPair, build_models
from examples.two_node_demo import Placement, run_two_nodes
from harness.launch import child_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
PAGE_SIZE = 16
LENGTHS = [20, 77, 128, 200, 300]  # 128 fills its pages; the others end in a partial page


def single_process_tokens(lengths, max_new_tokens):
    """The reference, computed here: target prefill and plain greedy decoding
    of the prompts the nodes derive from these flags."""
    node = parse_node_args(["--prompt-lengths", ",".join(map(str, lengths))])
    pair = model_pair(node)
    prompts = [r.prompt for r in make_requests(node, pair)]
    return reference_tokens(build_models(pair)[0], prompts, max_new_tokens, node.page_size)


def check_decode_result(decode: dict, prefill: list[dict], lengths, max_new_tokens) -> None:
    """Tokens equal the single-process run's; every KV byte is accounted for."""
    want = single_process_tokens(lengths, max_new_tokens)
    assert decode["failed"] == []
    rooms = sorted(decode["rooms"], key=lambda r: r["room"])
    assert [r["prompt_tokens"] for r in rooms] == lengths
    for room, tokens in zip(rooms, want):
        assert len(tokens) == max_new_tokens
        assert room["tokens"] == tokens, f"room {room['room']} ({room['prompt_tokens']} prompt tokens)"
    assert sum(r["accepted"] for r in rooms) > 0, "no draft token was ever accepted"
    # KV bytes: the prompt's pages of both pools, the last partial page whole.
    page_bytes = RankPools.allocate(ModelPair(), num_pages=1, page_size=PAGE_SIZE).page_bytes
    num_pages = sum(pages_for(n, PAGE_SIZE) for n in lengths)
    assert decode["kv_bytes"] == num_pages * page_bytes > 0
    assert decode["aux_bytes"] == len(lengths) * AUX_COLUMNS * 8
    # Selective send: one prefill rank writes the latent cache and the aux
    # rows, both write their half of the draft heads.
    pair, float32_bytes = ModelPair(), 4
    latent = num_pages * pair.target.num_layers * PAGE_SIZE * pair.target.latent_dim * float32_bytes
    half_draft = (num_pages * pair.draft.num_layers * 2 * PAGE_SIZE * (pair.draft.num_kv_heads // 2)
                  * pair.draft.head_dim * float32_bytes)
    # The aux rows go through the engine only to an unfenced decode node (else in RoomStatus).
    aux_by_engine = 0 if decode["fenced"] else decode["aux_bytes"]
    assert sorted(p["bytes_sent"] for p in prefill) == [half_draft, latent + half_draft + aux_by_engine]
    assert all(p["success"] == p["rooms"] == len(lengths) and p["failed"] == [] for p in prefill)


@pytest.fixture(scope="module")
def make_demo(tmp_path_factory):
    """One run of the whole demo (``make demo``): the transfer, then the
    storage step; its output and JSON."""
    out = tmp_path_factory.mktemp("demo") / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "examples.two_node_demo", "--json", str(out), "--timeout-s", "90"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_make_demo_matches_the_single_process_run(make_demo):
    proc, data = make_demo
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "5 of 5 prompts" in proc.stdout and "(DIFFERENT)" not in proc.stdout
    nodes = {n["name"]: n for n in data["nodes"]}
    assert set(nodes) == {"prefill rank 0", "prefill rank 1", "decode"}
    assert all(n["returncode"] == 0 for n in nodes.values())
    check_decode_result(nodes["decode"]["result"], [nodes[f"prefill rank {r}"]["result"] for r in (0, 1)],
                        LENGTHS, 24)


def test_only_requests_keeps_the_prompts_and_rooms_of_a_run_of_all():
    lengths = "20,77,128,200,300,64"
    every = make_requests(parse_node_args(["--prompt-lengths", lengths]), ModelPair())
    some = make_requests(parse_node_args(["--prompt-lengths", lengths, "--only-requests", "5,2"]), ModelPair())
    assert [r.room for r in some] == [1002, 1005]
    assert all(r.prompt.equal(every[r.room - 1000].prompt) for r in some)
    # Prompts are drawn in order: appending a length leaves the earlier prompts as they were.
    fewer = make_requests(parse_node_args(["--prompt-lengths", "20,77,128,200,300"]), ModelPair())
    assert all(a.prompt.equal(b.prompt) for a, b in zip(fewer, every))


STORAGE_LENGTHS = LENGTHS + [4 * PAGE_SIZE]  # the demo's prompts and one of 4 full pages


def test_demo_storage_step_skips_stored_pages_and_restores_a_killed_prefill(make_demo):
    """``make demo``'s storage step: run 2 loads every full page from the
    store and prefill sends only the partly filled last pages and the aux
    rows (counted in bytes on both sides); then, with the prefill node killed
    (SIGKILL) once it holds the decode node's requests for the two
    page-aligned prompts, the decode node restores both rooms from the store.
    Tokens equal the single-process run's throughout."""
    proc, data = make_demo
    output = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert data is not None and "storage" in data, output
    data = data["storage"]
    assert data["ok"] and "both behaviours shown" in proc.stdout and "DIFFERENT" not in proc.stdout, output
    want = single_process_tokens(STORAGE_LENGTHS, 24)
    page_bytes = RankPools.allocate(ModelPair(), num_pages=1, page_size=PAGE_SIZE).page_bytes
    aux_row = AUX_COLUMNS * 8

    # Write-through, then prefetch and selective send.
    first, second = data["runs"]
    for run in (first, second):
        assert [n["name"] for n in run] == ["prefill rank 0", "decode"]  # TP 1 -> TP 1
        assert all(n["returncode"] == 0 for n in run), run
        rooms = sorted(run[-1]["result"]["rooms"], key=lambda r: r["room"])
        assert [r["tokens"] for r in rooms] == want
    full = [n // PAGE_SIZE for n in STORAGE_LENGTHS]
    pages = [pages_for(n, PAGE_SIZE) for n in STORAGE_LENGTHS]
    assert first[0]["result"]["storage_pages_written"] == 2 * sum(full)  # target and draft
    rooms = sorted(data["rooms"], key=lambda r: r["room"])
    assert [r["first_pages_from_storage"] for r in rooms] == [0] * len(pages)
    assert [r["pages_from_storage"] for r in rooms] == full and sum(full) > 0
    assert [r["first_network_kv_bytes"] for r in rooms] == [n * page_bytes for n in pages]
    assert [r["network_kv_bytes"] for r in rooms] == [(n - f) * page_bytes for n, f in zip(pages, full)]
    assert all(r["network_kv_bytes"] < r["first_network_kv_bytes"] and r["same_tokens"] for r in rooms)
    # What the prefill node's engine wrote: every page, then the partial last pages; the aux rows both
    # times, unless decode is fenced (its default: then they travel in RoomStatus).
    assert first[-1]["result"]["fenced"] == second[-1]["result"]["fenced"]
    aux = 0 if first[-1]["result"]["fenced"] else len(STORAGE_LENGTHS) * aux_row
    assert first[0]["result"]["bytes_sent"] == sum(pages) * page_bytes + aux
    assert second[0]["result"]["bytes_sent"] == (sum(pages) - sum(full)) * page_bytes + aux
    assert second[0]["result"]["storage_pages_written"] == 0  # all there already

    # Fallback: prefill killed before sending; decode restores the rooms from the store.
    fallback = data["fallback"]
    aligned = [1000 + i for i, n in enumerate(STORAGE_LENGTHS) if n % PAGE_SIZE == 0]
    assert aligned == fallback["rooms_requested"] == [1002, 1005]
    assert fallback["killed_at"] is not None and not fallback["sent_before_kill"]
    prefill, decode = fallback["nodes"]
    assert prefill["returncode"] == -9 and prefill["result"] is None  # SIGKILL-ed, no RESULT line
    assert decode["returncode"] == 0 and decode["result"]["failed"] == []
    assert decode["result"]["network_kv_bytes"] == 0
    restored = sorted(decode["result"]["rooms"], key=lambda r: r["room"])
    assert [r["room"] for r in restored] == aligned
    for room in restored:
        i = room["room"] - 1000
        assert room["tokens"] == want[i]
        assert room["prefetched_pages"] == 0 and room["restored_pages"] == room["pages"] == full[i]
        after = room["ended_at"] - fallback["killed_at"]
        assert 0 < after < fallback["peer_timeout_s"] + 8, after
    assert [r["room"] for r in fallback["rooms"] if r["same_tokens"]] == aligned


def test_a_page_size_mismatch_fails_every_node_with_a_reason():
    runs = run_two_nodes(["--prompt-lengths", "20,40", "--timeout-s", "4"], ["--page-size", "8"], timeout_s=60)
    decode = runs[-1]
    assert decode.returncode == 1 and decode.result is not None, decode.log[-2000:]
    reasons = " ".join(why for _, why in decode.result["failed"])
    assert "page_size" in reasons, decode.log[-2000:]
    for prefill in runs[:-1]:  # told by the decode node, or out of time waiting for its requests
        assert prefill.returncode == 1 and prefill.result["success"] == 0, prefill.log[-2000:]


# --- two hosts: network namespaces ------------------------------------------------------------


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def two_hosts(monkeypatch):
    """Two network namespaces joined by a veth pair: the prefill host at
    10.77.0.1, the decode host at 10.77.0.2; nothing else is reachable.
    Their addresses are not loopback: the bootstrap server and the ranks run
    unauthenticated only with KVFERRY_INSECURE=1 (protected mode)."""
    monkeypatch.setenv("KVFERRY_INSECURE", "1")
    # On NIXL, UCX takes the veth (the tests' default is loopback only); the
    # namespaces hold nothing else.
    monkeypatch.setenv("UCX_NET_DEVICES", "all")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (id -u is not 0)")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    tag = str(os.getpid())
    prefill_ns, decode_ns = f"kvf-p-{tag}", f"kvf-d-{tag}"
    created = []
    try:
        for ns in (prefill_ns, decode_ns):
            r = _ip("netns", "add", ns)
            if r.returncode != 0:
                pytest.skip(f"`ip netns add` does not work here: {r.stderr.strip()}")
            created.append(ns)
        steps = [("link", "add", f"kvfp{tag}"[:15], "netns", prefill_ns, "type", "veth", "peer", "name",
                  f"kvfd{tag}"[:15], "netns", decode_ns)]
        for ns, dev, addr in ((prefill_ns, f"kvfp{tag}"[:15], "10.77.0.1/24"),
                              (decode_ns, f"kvfd{tag}"[:15], "10.77.0.2/24")):
            steps += [("-n", ns, "addr", "add", addr, "dev", dev), ("-n", ns, "link", "set", dev, "up"),
                      ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                pytest.skip(f"cannot set up the namespaces' link (ip {' '.join(step)}): {r.stderr.strip()}")
        yield Placement(prefill_host="10.77.0.1", decode_host="10.77.0.2",
                        prefill_prefix=("ip", "netns", "exec", prefill_ns),
                        decode_prefix=("ip", "netns", "exec", decode_ns))
    finally:
        for ns in created:  # deleting a namespace deletes its end of the veth pair too
            _ip("netns", "del", ns)


def test_prefill_and_decode_on_two_hosts(two_hosts):
    lengths = [33, 160, 250]
    runs = run_two_nodes(["--prompt-lengths", ",".join(map(str, lengths)), "--timeout-s", "45"],
                         ["--max-new-tokens", "16"], placement=two_hosts, timeout_s=90)
    for run in runs:
        assert run.returncode == 0 and run.result is not None, f"{run.name}:\n{run.log[-3000:]}"
    assert "10.77.0.1:" in runs[0].log  # registered with the bootstrap server on the prefill host
    check_decode_result(runs[-1].result, [r.result for r in runs[:-1]], lengths, 16)
