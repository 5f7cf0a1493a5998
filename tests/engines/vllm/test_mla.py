"""DeepSeek-style MLA through kvferry's vLLM connector, with real vLLM servers.

A tiny random DeepSeek-V2-style model (``harness.vllm.build_tiny_mla_model``:
one latent cache of 512 + 64 values per token and layer, vLLM's CPU_MLA
backend) served by a single instance (the reference) and by a prefill +
decode pair with kvferry. vLLM hands the connector one 4-D latent tensor per
layer (``[blocks, 1, 16, 576]`` on CPU); kvferry moves it as its MLA pool
(one latent page per block, sent by one rank: the selective send).

Checked, per prompt of 37-1000 tokens: decode's tokens equal those of
vLLM's own NixlConnector pair on the same prompts (the honest reference: a
decode that resumes from received MLA KV takes a path a single instance
never takes, see docs/vllm.md), and its first token the single instance's;
every prompt token counted as external on decode's ``/metrics``; and the
bytes that moved, block by block over all layers, equal on both sides (the
test connector's digests, ``corrupting.py``).
"""

from __future__ import annotations

import random
import re

import pytest

pytest.importorskip("vllm")

from harness.vllm import (VOCAB, ServerSpec, VLLMServer, build_tiny_mla_model, complete, free_port,  # noqa: E402
                          pd_complete, warm_up)

MAX_TOKENS = 8
LENGTHS = (37, 100, 257, 640, 1000)
MLA_BLOCK = 16  # vLLM's CPU MLA block (its kernel's only size)
MLA_BLOCK_BYTES = 4 * MLA_BLOCK * 576 * 2  # layers x tokens x latent values x bf16
TEST_CONNECTOR = {"kv_connector": "CorruptingKvferryConnector",
                  "kv_connector_module_path": "tests.engines.vllm.corrupting"}


def kv_config(role: str, bootstrap: str) -> dict:
    extra = {"kvferry_bootstrap_addr": bootstrap, "kvferry_node": "mla-prefill",
             "kvferry": {"bootstrap_timeout_s": 15, "transfer_timeout_s": 30, "model_name": "tiny-mla"}}
    if role == "kv_producer":
        extra["kvferry_serve_bootstrap"] = True
    return {**TEST_CONNECTOR, "kv_role": role, "kv_connector_extra_config": extra}


def digests(server: VLLMServer, side: str) -> dict[int, list[str]]:
    """room -> the block digests ``side`` logged for it (corrupting.py)."""
    out = {}
    for m in re.finditer(rf"kvferry-test: digest side={side} room=(\d+) blocks=\d+ skip=\d+ sha=([0-9a-f,]+)",
                         server.log_tail(10_000_000)):
        out[int(m.group(1))] = m.group(2).split(",")
    return out


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-mla")
    model = build_tiny_mla_model(str(root / "model"))
    bootstrap = f"127.0.0.1:{free_port()}"
    env = {"KVFERRY_TEST_DIGEST": "1"}
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    servers = {"reference": VLLMServer(ServerSpec("reference", model, 0), str(root)),
               "nixl-prefill": VLLMServer(ServerSpec("nixl-prefill", model, 0, nixl,
                                                     env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}),
                                          str(root)),
               "nixl-decode": VLLMServer(ServerSpec("nixl-decode", model, 1, nixl,
                                                    env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}),
                                         str(root)),
               "prefill": VLLMServer(ServerSpec("prefill", model, 0, kv_config("kv_producer", bootstrap), env=env),
                                     str(root)),
               "decode": VLLMServer(ServerSpec("decode", model, 1, kv_config("kv_consumer", bootstrap), env=env),
                                    str(root))}
    try:
        for server in servers.values():
            server.wait_ready(300)
        print(f"warm-up request: {warm_up(servers['prefill'], servers['decode'], model)}")
        yield model, servers
    finally:
        for server in servers.values():
            server.close()


def test_mla_moves_every_prompt_token_page_exact_and_decode_tokens_equal_vllms_own_connectors(mla):
    model, servers = mla
    prefill, decode = servers["prefill"], servers["decode"]
    before = decode.metrics()
    rooms, matches = [], []
    for i, n in enumerate(LENGTHS):
        rng = random.Random(100 + i)
        prompt = [rng.randrange(4, VOCAB) for _ in range(n)]
        want = complete(servers["reference"], model, prompt, MAX_TOKENS).tokens
        got = pd_complete(prefill, decode, model, prompt, MAX_TOKENS)
        nixl = pd_complete(servers["nixl-prefill"], servers["nixl-decode"], model, prompt, MAX_TOKENS)
        assert got.tokens == nixl.tokens, f"{n} tokens: kvferry's decode {got.tokens} != NixlConnector's {nixl.tokens}"
        # Decode recomputes the prompt's last token (vLLM does, to get its logits) as a one-token
        # step over the received cache: the CPU MLA backend's decode kernel, where a single instance
        # computed that token in its prefill kernel. The two differ in the last bits, and this
        # random model's near-ties can turn a later token (vLLM's own MooncakeConnector and
        # NixlConnector show the same; docs/vllm.md). The first token, and every byte moved, must match.
        assert got.tokens[0] == want[0], f"{n} tokens: decode {got.tokens} != single instance {want}"
        matches.append(got.tokens == want)
        rooms.append((n, int(got.kv_params["kvferry_room"])))
    after = decode.metrics()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("external_kv_transfer") == sum(LENGTHS), (delta, decode.kvferry_lines())
    assert delta.get("local_compute", 0) == 0, delta
    sent, landed = digests(prefill, "prefill"), digests(decode, "decode")
    for n, room in rooms:
        assert room in sent and room in landed, (room, sorted(sent), sorted(landed))
        assert len(landed[room]) == -(-n // MLA_BLOCK), (n, len(landed[room]))
        assert sent[room] == landed[room], f"{n} tokens: blocks differ between prefill and decode"
    print(f"decode's tokens equal NixlConnector's for every prompt, the single instance's for {sum(matches)} "
          f"of {len(matches)}")
