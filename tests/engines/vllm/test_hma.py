"""Sliding-window attention with vLLM's hybrid KV-cache manager (HMA) on,
through kvferry's vLLM connector, with real vLLM servers.

A tiny random Gemma-3-style model (``harness.vllm.build_tiny_sliding_model``:
layers alternating a 96-token window and full attention) gives vLLM two
KV-cache groups, each with block ids of its own; the window group's blocks
before the window are freed (vLLM's null block). kvferry moves the full
group as its KV pool and the window group as a page-indexed state pool
(``transfer.adapters.vllm_groups``): decode asks for the window's blocks
only.

Checked, per prompt of 37-1000 tokens: decode's tokens equal a single
instance's (HMA on there too); every prompt token counted as external on
decode's ``/metrics``; the full group's blocks byte-equal on both sides, and
every window block decode holds byte-equal to prefill's block at the same
position (the test connector's digests, ``corrupting.py``), with decode
holding only the window's blocks of a long prompt.
"""

from __future__ import annotations

import random
import re

import pytest

pytest.importorskip("vllm")

from harness.vllm import (SLIDING_WINDOW, VOCAB, ServerSpec, VLLMServer, build_tiny_sliding_model,  # noqa: E402
                          complete, free_port, pd_complete, warm_up)

MAX_TOKENS = 8
LENGTHS = (37, 100, 257, 640, 1000)
BLOCK = 32
ARGS = ("--block-size", str(BLOCK))
TEST_CONNECTOR = {"kv_connector": "CorruptingKvferryConnector",
                  "kv_connector_module_path": "tests.engines.vllm.corrupting"}


def kv_config(role: str, bootstrap: str) -> dict:
    extra = {"kvferry_bootstrap_addr": bootstrap, "kvferry_node": "hma-prefill",
             "kvferry": {"bootstrap_timeout_s": 15, "transfer_timeout_s": 30, "model_name": "tiny-gemma3"}}
    if role == "kv_producer":
        extra["kvferry_serve_bootstrap"] = True
    return {**TEST_CONNECTOR, "kv_role": role, "kv_connector_extra_config": extra}


def digests(server: VLLMServer, side: str, kind: str = "digest") -> dict:
    """room -> the block digests ``side`` logged for it (``kind`` group-digest: (room, group) ->)."""
    out = {}
    log = server.log_tail(10_000_000)
    if kind == "digest":
        for m in re.finditer(rf"kvferry-test: digest side={side} room=(\d+) blocks=\d+ skip=\d+ sha=([0-9a-f,]+)",
                             log):
            out[int(m.group(1))] = m.group(2).split(",")
    else:
        for m in re.finditer(rf"kvferry-test: group-digest side={side} room=(\d+) group=(\d+) sha=([0-9a-f,-]+)",
                             log):
            out[(int(m.group(1)), int(m.group(2)))] = m.group(3).split(",")
    return out


@pytest.fixture(scope="module")
def hma(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-hma")
    model = build_tiny_sliding_model(str(root / "model"))
    bootstrap = f"127.0.0.1:{free_port()}"
    env = {"KVFERRY_TEST_DIGEST": "1"}
    servers = {"reference": VLLMServer(ServerSpec("reference", model, 0, args=ARGS), str(root)),
               "prefill": VLLMServer(ServerSpec("prefill", model, 0, kv_config("kv_producer", bootstrap), env=env,
                                                args=ARGS), str(root)),
               "decode": VLLMServer(ServerSpec("decode", model, 1, kv_config("kv_consumer", bootstrap), env=env,
                                               args=ARGS), str(root))}
    try:
        for server in servers.values():
            server.wait_ready(300)
        print(f"warm-up request: {warm_up(servers['prefill'], servers['decode'], model)}")
        yield model, servers
    finally:
        for server in servers.values():
            server.close()


def test_sliding_window_groups_move_page_exact_and_decode_tokens_equal_a_single_instance(hma):
    model, servers = hma
    prefill, decode = servers["prefill"], servers["decode"]
    for server in servers.values():
        assert "Turning off hybrid kv cache manager" not in server.log_tail(10_000_000), server.spec.name
    before = decode.metrics()
    rooms = []
    for i, n in enumerate(LENGTHS):
        rng = random.Random(300 + i)
        prompt = [rng.randrange(4, VOCAB) for _ in range(n)]
        want = complete(servers["reference"], model, prompt, MAX_TOKENS).tokens
        got = pd_complete(prefill, decode, model, prompt, MAX_TOKENS)
        assert got.tokens == want, f"{n} tokens: decode {got.tokens} != single instance {want}"
        rooms.append((n, int(got.kv_params["kvferry_room"])))
    after = decode.metrics()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("external_kv_transfer") == sum(LENGTHS), (delta, decode.kvferry_lines())
    assert delta.get("local_compute", 0) == 0, delta
    sent, landed = digests(prefill, "prefill"), digests(decode, "decode")
    sent_w, landed_w = digests(prefill, "prefill", "group"), digests(decode, "decode", "group")
    groups = sorted({g for _, g in landed_w})
    assert len(groups) == 1, f"expected one window group beside the full one, got {groups}"
    for n, room in rooms:
        blocks = -(-n // BLOCK)
        assert room in sent and room in landed, (room, sorted(sent), sorted(landed))
        assert len(landed[room]) == blocks and sent[room] == landed[room], f"{n} tokens: full-attention blocks differ"
        src, dst = sent_w[(room, groups[0])], landed_w[(room, groups[0])]
        assert len(src) == len(dst) == blocks, (n, len(src), len(dst))
        wanted = [i for i, d in enumerate(dst) if d != "-"]
        assert wanted, f"{n} tokens: decode wanted no window block"
        assert all(src[i] == dst[i] for i in wanted), f"{n} tokens: window blocks differ between prefill and decode"
        # decode holds the window's blocks only (the freed ones are vLLM's null block, never written)
        assert len(wanted) <= -(-SLIDING_WINDOW // BLOCK) + 1, (n, wanted)
        assert wanted == list(range(blocks - len(wanted), blocks)), (n, wanted)
