"""DeepSeek-style MLA from a prefill at TP 2 to a decode at TP 1 through
kvferry's vLLM connector, with real vLLM servers.

MLA's latent cache is the same on every TP rank: one prefill rank sends it
and the other answers without sending (the selective send). Prefill runs
vLLM's TP 2 (two worker processes, both bound to core 0: a TP worker and a
decode sharing a core starve each other on this 2-core machine), decode TP 1
on core 1, the single instance (the reference) on core 1 too.

Checked on 3 prompts of 37-1000 tokens: both prefill ranks hold the same
latent blocks and decode's equal them byte for byte (the test connector's
digests); the bytes moved, on prefill's and on decode's ``/metrics``, are one
copy of the prompt's blocks (not one per prefill rank); every prompt token
external on decode; decode's first token equals a single instance's (a TP 2
prefill sums its all-reduces in another order than a TP 1 one, so later
tokens of this random model may turn, as they may across connectors: see
``test_mla.py``).

The cluster's first PD request is the first of these prompts, checked like
the others (it once failed in CI with decode waiting 15 s for both prefill
ranks' handshake: a prefill engine's first write then ran Mooncake's P2P
handshake; the way to a decode rank is now opened while its hello is
answered, docs/transports.md).
"""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("vllm")

from harness.vllm import (VOCAB, ServerSpec, VLLMServer, build_tiny_mla_model, complete, free_ports,  # noqa: E402
                          pd_complete)
from tests.engines.vllm.pd_servers import (kvferry_pair, logged, prompt_sources_since, rank_digests,  # noqa: E402
                                           running)
from tests.engines.vllm.test_mla import MLA_BLOCK, MLA_BLOCK_BYTES, MODEL_NAME, NODE  # noqa: E402
from tests.engines.vllm.test_pd import stats_of  # noqa: E402

MAX_TOKENS = 4
LENGTHS = (37, 300, 1000)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-mla-tp")
    model = build_tiny_mla_model(str(root / "model"))
    bootstrap = f"127.0.0.1:{free_ports(2)}"  # prefill serves HTTP there, kvferry's ZMQ bootstrap beside it
    servers = {"reference": VLLMServer(ServerSpec("reference", model, 1), str(root)),
               **kvferry_pair(model, str(root), bootstrap, NODE, MODEL_NAME,
                              prefill_env={"VLLM_CPU_OMP_THREADS_BIND": "0|0"},
                              prefill_args=("--tensor-parallel-size", "2"))}
    with running(servers):
        yield model, servers


def test_mla_from_prefill_tp2_to_decode_tp1_is_sent_once_byte_exact(tp2):
    model, servers = tp2
    prefill, decode = servers["prefill"], servers["decode"]
    before = decode.metrics()
    moved_before = {name: stats_of(s) for name, s in (("prefill", prefill), ("decode", decode))}
    rooms = []
    for i, n in enumerate(LENGTHS):
        rng = random.Random(900 + i)
        prompt = [rng.randrange(4, VOCAB) for _ in range(n)]
        want = complete(servers["reference"], model, prompt, MAX_TOKENS).tokens
        got = pd_complete(prefill, decode, model, prompt, MAX_TOKENS)
        assert got.tokens[0] == want[0], f"{n} tokens: decode {got.tokens} != single instance {want}"
        rooms.append((n, int(got.kv_params["kvferry_room"])))
    delta = prompt_sources_since(decode, before)
    assert delta.get("external_kv_transfer") == sum(LENGTHS), (delta, decode.kvferry_lines())
    assert delta.get("local_compute", 0) == 0, delta
    logged(prefill, "prefill", [room for _, room in rooms], ranks=2)
    sent, landed = rank_digests(prefill, "prefill"), rank_digests(decode, "decode")
    for n, room in rooms:
        assert len(sent.get(room, [])) == 2, f"{n} tokens: {len(sent.get(room, []))} prefill ranks ended the room"
        assert sent[room][0] == sent[room][1], f"{n} tokens: the two prefill ranks' latent blocks differ"
        assert landed[room] == [sent[room][0]] and len(landed[room][0]) == -(-n // MLA_BLOCK), \
            f"{n} tokens: decode's blocks differ from prefill's"
    one_copy = sum(-(-n // MLA_BLOCK) for n in LENGTHS) * MLA_BLOCK_BYTES
    for name, server in (("prefill", prefill), ("decode", decode)):
        started = time.monotonic()
        while True:  # a rank reports a room at its engine's next step after the room ended
            now = stats_of(server)
            rooms_ended = now["bytes_transferred_count"] - moved_before[name]["bytes_transferred_count"]
            if rooms_ended >= len(LENGTHS) * (2 if name == "prefill" else 1) or time.monotonic() - started > 10:
                break
            time.sleep(0.2)
        moved = sum(now[p] - moved_before[name][p] for p in ("direct", "staged"))
        assert moved == one_copy, f"{name} counted {moved} bytes moved ({rooms_ended} rooms), one copy is {one_copy}"
