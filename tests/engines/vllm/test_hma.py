"""Sliding-window attention with vLLM's hybrid KV-cache manager (HMA) on,
through kvferry's vLLM connector, with real vLLM servers.

A tiny random Gemma-3-style model (``harness.vllm.build_tiny_sliding_model``:
layers alternating a 96-token window and full attention) gives vLLM two
KV-cache groups, each with block ids of its own; the window group's blocks
before the window are freed (vLLM's null block). kvferry moves the full
group as its KV pool and the window group as a page-indexed state pool
(``transfer.adapters.vllm.groups``): decode asks for the window's blocks
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

import pytest

pytest.importorskip("vllm")

from harness.vllm import (SLIDING_WINDOW, VOCAB, ServerSpec, VLLMServer, build_tiny_sliding_model,  # noqa: E402
                          complete, free_ports, pd_complete)
from tests.engines.vllm.pd_servers import (digests, group_digests, kvferry_pair, logged, prompt_sources_since,  # noqa: E402
                                           running)

MAX_TOKENS = 8
LENGTHS = (37, 100, 257, 640, 1000)
BLOCK = 32
ARGS = ("--block-size", str(BLOCK))
NODE, MODEL_NAME = "hma-prefill", "tiny-gemma3"


@pytest.fixture(scope="module")
def hma(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-hma")
    model = build_tiny_sliding_model(str(root / "model"))
    bootstrap = f"127.0.0.1:{free_ports(2)}"  # prefill serves HTTP there, kvferry's ZMQ bootstrap beside it
    servers = {"reference": VLLMServer(ServerSpec("reference", model, 0, args=ARGS), str(root)),
               **kvferry_pair(model, str(root), bootstrap, NODE, MODEL_NAME, args=ARGS)}
    with running(servers):
        yield model, servers


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
    delta = prompt_sources_since(decode, before)
    assert delta.get("external_kv_transfer") == sum(LENGTHS), (delta, decode.kvferry_lines())
    assert delta.get("local_compute", 0) == 0, delta
    logged(prefill, "prefill", [room for _, room in rooms])
    sent, landed = digests(prefill, "prefill"), digests(decode, "decode")
    sent_w, landed_w = group_digests(prefill, "prefill"), group_digests(decode, "decode")
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
