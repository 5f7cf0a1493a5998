"""Layer-wise sends driven by vLLM's forward pass (``kvferry_layer_groups``),
with real vLLM servers.

Prefill streams a request's KV in 4 layer groups (one per layer of the tiny
4-layer Llama) from ``save_kv_layer``, in the engine step that completes
its prefill; decode runs with the connector's defaults (the write fence on):
each group lands in decode's staging, and decode scatters it into the
request's blocks at once.

Checked, on prompts of 37-1000 tokens: decode's tokens equal a single
instance's and every block's bytes equal on both sides, with both
protocols. With the concurrent one (decode's request waits at prefill before
prefill's forward pass), the groups go while the forward pass goes on; with
the sequential one (decode asks after prefill answered) every group goes
after it: prefill's ``vllm:kvferry_layer_groups_total`` counts which. What
these CPU servers cannot show is the speed-up: the forward pass and the TCP
copy share two cores (benchmarks/layerwise.py models a GPU's prefill).
"""

from __future__ import annotations

import random
import threading
import time
import uuid

import pytest

pytest.importorskip("vllm")

from harness.vllm import VOCAB, VLLMServer, _body, complete, free_ports, pd_complete, post, tokens_of  # noqa: E402
from tests.engines.vllm.pd_servers import (digests, kvferry_pair, logged, prompt_sources_since, reported,  # noqa: E402
                                           running, settled_metric)

MAX_TOKENS = 8
LENGTHS = (37, 300, 1000)
GROUPS = 4  # one per layer of the tiny model
NODE = "layerwise-prefill"
GROUPS_METRIC = "vllm:kvferry_layer_groups_total"
PARTS_METRIC = "vllm:kvferry_num_descriptors_sum"  # per room, decode: the staged parts it scattered


@pytest.fixture(scope="module")
def layerwise(tmp_path_factory, tiny_llama):
    model, reference = tiny_llama
    root = tmp_path_factory.mktemp("vllm-layerwise")
    bootstrap = f"127.0.0.1:{free_ports(2)}"  # prefill serves HTTP there, kvferry's ZMQ bootstrap beside it
    pair = kvferry_pair(model, str(root), bootstrap, NODE, "tiny-llama",
                        # every prompt here is shorter than layerwise_min_tokens' default: stream them anyway
                        prefill_kv={"extra": {"kvferry_layer_groups": GROUPS}, "manager": {"layerwise_min_tokens": 0}})
    with running(pair, shared={"reference": reference}) as servers:
        yield model, servers, bootstrap


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def _check_blocks(prefill: VLLMServer, decode: VLLMServer, rooms: list[int]) -> None:
    logged(prefill, "prefill", rooms)
    sent, landed = digests(prefill, "prefill"), digests(decode, "decode")
    for room in rooms:
        assert room in sent and room in landed, (room, sorted(sent), sorted(landed))
        assert landed[room] and sent[room] == landed[room], f"room {room}: blocks differ"


def test_concurrent_protocol_streams_the_layer_groups_during_prefills_forward_pass(layerwise):
    model, servers, bootstrap = layerwise
    prefill, decode = servers["prefill"], servers["decode"]
    forward, after = prefill.gauge(GROUPS_METRIC, when="forward"), prefill.gauge(GROUPS_METRIC, when="after")
    before, parts = decode.metrics(), decode.gauge(PARTS_METRIC)
    rooms = []
    for i, n in enumerate(LENGTHS):
        prompt, transfer_id = _prompt(n, 700 + i), str(uuid.uuid4())
        want = complete(servers["reference"], model, prompt, MAX_TOKENS).tokens
        params = {"do_remote_prefill": True, "transfer_id": transfer_id, "kvferry_bootstrap_addr": bootstrap,
                  "kvferry_node": NODE}
        reply: dict = {}
        t = threading.Thread(target=lambda: reply.update(post(decode.url, _body(model, prompt, MAX_TOKENS, params),
                                                              120)))
        t.start()
        time.sleep(2)  # decode's request reaches prefill (in well under a second) and waits for the room
        first = post(prefill.url, _body(model, prompt, 1, {"do_remote_decode": True, "transfer_id": transfer_id}),
                     120)
        t.join(120)
        assert not t.is_alive(), "decode did not answer within 120 s"
        assert tokens_of(reply) == want, f"{n} tokens: decode {tokens_of(reply)} != single instance {want}"
        rooms.append(int(first["kv_transfer_params"]["kvferry_room"]))
    total = GROUPS * len(LENGTHS)
    streamed = settled_metric(prefill, GROUPS_METRIC, forward + total, when="forward") - forward
    late = prefill.gauge(GROUPS_METRIC, when="after") - after
    print(f"layer groups sent during the forward pass: {streamed:g}, after it: {late:g}")
    assert streamed + late == total, (streamed, late, prefill.kvferry_lines())
    assert streamed >= GROUPS, "no request's groups went during the forward pass"
    # a fenced decode counts each staged part it scattered: one per group here (a chunk held whole is one part)
    scattered = settled_metric(decode, PARTS_METRIC, parts + total) - parts
    assert scattered == total, f"decode scattered {scattered:g} staged parts for {total} layer groups"
    assert prompt_sources_since(decode, before).get("external_kv_transfer") == sum(LENGTHS)
    _check_blocks(prefill, decode, rooms)


def test_sequential_protocol_sends_every_group_once_decode_asks(layerwise):
    model, servers, _ = layerwise
    prefill, decode = servers["prefill"], servers["decode"]
    reported((prefill, decode), model)  # the rooms before counted before the baseline
    after = prefill.gauge(GROUPS_METRIC, when="after")
    rooms = []
    for i, n in enumerate(LENGTHS):
        prompt = _prompt(n, 800 + i)
        want = complete(servers["reference"], model, prompt, MAX_TOKENS).tokens
        got = pd_complete(prefill, decode, model, prompt, MAX_TOKENS)
        assert got.tokens == want, f"{n} tokens: decode {got.tokens} != single instance {want}"
        rooms.append(int(got.kv_params["kvferry_room"]))
    total = GROUPS * len(LENGTHS)
    assert settled_metric(prefill, GROUPS_METRIC, after + total, when="after") - after == total
    _check_blocks(prefill, decode, rooms)
