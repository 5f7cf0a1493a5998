"""Real SGLang servers with kvferry as their transfer backend (``make test-sglang-server``).

A tiny random Llama served three ways by ``python -m sglang.launch_server`` on
the CPU: a single server (the reference), and a prefill + decode pair with
``--disaggregation-transfer-backend kvferry`` (kvferry's bootstrap server
started by SGLang's prefill on its bootstrap port). Requests go to both PD
servers at once with a bootstrap room, as SGLang's router sends them; the
decode server has no way to compute a prompt, so every token it returns was
generated over KV kvferry moved, and must equal the single server's.

SGLang's own ``mooncake`` backend does not run PD on this CPU: its prefill
scheduler dies on the first transfer (``pin_memory=True requires a CUDA or
other accelerator backend``, SGLang 0.5.23's ``prefill.py`` pins a host
index tensor when the sender supports host tensor indices): so no side-by-side
row here (docs/sglang.md).
"""

from __future__ import annotations

import json
import random
import threading
import urllib.request

import pytest

pytest.importorskip("sglang")

from harness.sglang_server import SGLangServer, SGLangSpec, generate, pd_generate  # noqa: E402
from harness.vllm import VOCAB, build_tiny_model, free_port  # noqa: E402

MAX_NEW = 12
PREFILL_HOST = "127.0.0.2"
# SGLang 0.5.23's prefill sends a prompt's prefix found in its radix cache early, before the forward
# (SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX, on by default); under overlap scheduling it records a
# torch.cuda.Event for that send, which kills its scheduler without CUDA, whatever the backend. With
# overlap off the early send runs as on a GPU, without the event (kvferry's sender waits on it when
# given: tests/unit, the CUDA-event stand-ins).
PREFILL_ARGS = ("--disable-overlap-schedule",)
LENGTHS = (8, 100, 257, 600)


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-server")
    model = build_tiny_model(str(root / "model"))
    bootstrap = free_port()
    # kvferry's own bootstrap port (beside SGLang's HTTP one): a free one, not the default next port
    # prefill on an address of its own, not localhost's: sglang-router forwards its --prefill URL's host
    # as the bootstrap host, and kvferry's bootstrap and ranks must answer there (issue 41)
    specs = [SGLangSpec("reference", model), SGLangSpec("prefill", model, "prefill", bootstrap_port=bootstrap,
                                                        env={"KVFERRY_SGLANG_BOOTSTRAP_PORT": str(free_port())},
                                                        host=PREFILL_HOST, args=PREFILL_ARGS),
             SGLangSpec("decode", model, "decode")]
    started = []
    try:
        for spec in specs:
            started.append(SGLangServer(spec, str(root)))
        for server in started:
            server.wait_ready()
        yield {s.spec.name: s for s in started}
    finally:
        for server in started:
            server.close()


def test_decode_tokens_equal_a_single_server(servers):
    reference, prefill, decode = servers["reference"], servers["prefill"], servers["decode"]
    for i, n in enumerate(LENGTHS):
        prompt = prompt_of(n, i)
        want = generate(reference, prompt, MAX_NEW)["output_ids"]
        first, got = pd_generate(prefill, decode, prompt, MAX_NEW, room=7_000 + i)
        assert len(want) == MAX_NEW and got["output_ids"] == want, (n, got["output_ids"], want)
        assert first["output_ids"][:1] == want[:1], (n, first["output_ids"], want)  # prefill's own first token
        assert got["meta_info"]["prompt_tokens"] == n
    for server in (prefill, decode):
        lines = server.kvferry_lines()
        assert f"kvferry {server.spec.mode} rank tp 0/1 dp 0/1 ready" in lines, lines
        assert "failed" not in lines, lines


def test_a_prefix_in_prefills_radix_cache_goes_early_and_decode_tokens_still_equal(servers):
    """A prompt whose first 256 tokens prefill computed before, then the same
    prompt again: prefill finds the prefix in its radix cache (its reply's
    ``cached_tokens``) and SGLang sends those pages early, in a chunk of
    their own before the forward, the rest after; decode's tokens equal the
    single server's both times."""
    reference, prefill, decode = servers["reference"], servers["prefill"], servers["decode"]
    base = prompt_of(400, 300)
    extended = base[:256] + prompt_of(150, 301)
    # the first puts the prefix in prefill's cache (a prompt's last token is always computed)
    for i, (prompt, cached) in enumerate(((base, 0), (extended, 256), (base, 399))):
        want = generate(reference, prompt, MAX_NEW)["output_ids"]
        first, got = pd_generate(prefill, decode, prompt, MAX_NEW, room=7_100 + i)
        assert first["meta_info"]["cached_tokens"] >= cached, first["meta_info"]
        assert got["output_ids"] == want, (len(prompt), got["output_ids"], want)
    lines = prefill.kvferry_lines() + decode.kvferry_lines()
    assert "failed" not in lines, lines


def test_behind_sglang_router_unchanged_tokens_equal_a_single_server(servers, tmp_path):
    """sglang-router 0.3.2 (the package users deploy), ``--pd-disaggregation``
    at its defaults in front of the pair: it picks the room and posts the
    same body to prefill and decode at once; decode's tokens equal the
    single server's."""
    pytest.importorskip("sglang_router")
    from harness.sglang_server import SGLangRouter

    reference, prefill, decode = servers["reference"], servers["prefill"], servers["decode"]
    router = SGLangRouter(prefill, decode, str(tmp_path))
    try:
        router.wait_ready(90)
        for i, n in enumerate((50, 300, 900)):
            prompt = prompt_of(n, 100 + i)
            want = generate(reference, prompt, MAX_NEW)["output_ids"]
            got = generate(router, prompt, MAX_NEW)
            assert got["output_ids"] == want, (n, got["output_ids"], want, router.log_tail())
            assert got["meta_info"]["prompt_tokens"] == n
    finally:
        router.close()
    lines = decode.kvferry_lines()
    assert "failed" not in lines, lines


RETRACT_NEW = 32  # tokens a retracted request generates in all


def _stream_tokens(server, body: dict, timeout_s: float = 120.0):
    """``/generate`` with ``stream``: yields the output ids so far (SGLang's
    streamed ``output_ids`` are cumulative) until the stream ends."""
    req = urllib.request.Request(server.url + "/generate", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            if "error" in chunk:
                raise RuntimeError(f"{server.spec.name}: {chunk['error']}")
            yield chunk["output_ids"]


def _post(server, path: str, body: dict, timeout_s: float = 60.0) -> None:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as reply:
        reply.read()


def test_a_request_retracted_on_decode_is_recomputed_by_prefill_and_tokens_equal_a_single_server(servers):
    """SGLang's PD true-retraction rebootstrap with kvferry: decode is paused
    with ``mode: retract`` while it generates (``pause_generation``), then
    resumed (``continue_generation``); SGLang's decode posts the retracted
    request's prompt and outputs to the prefill server's ``/generate``
    (kvferry's ``submit_prefill_recompute``, the URL from the HTTP port the
    prefill registered), prefill recomputes the KV and kvferry moves it to
    decode again, under the same room. Decode's tokens equal the single server's."""
    reference, prefill, decode = servers["reference"], servers["prefill"], servers["decode"]
    prompt = prompt_of(300, 700)
    want = generate(reference, prompt, RETRACT_NEW)["output_ids"]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": RETRACT_NEW, "temperature": 0.0,
                                                     "ignore_eos": True},
            "bootstrap_host": prefill.spec.host, "bootstrap_port": prefill.spec.bootstrap_port,
            "bootstrap_room": 7_200}
    first: dict = {}
    threading.Thread(target=lambda: first.update(generate(prefill, prompt, RETRACT_NEW, **{
        k: body[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")})), daemon=True).start()
    seen, got = 0, []
    for got in _stream_tokens(decode, body):
        if seen == 0 and len(got) >= 4:  # decode is generating over the KV kvferry moved: retract it now
            seen = len(got)
            _post(decode, "/pause_generation", {"mode": "retract"})
            _post(decode, "/continue_generation", {})
    assert seen and seen < RETRACT_NEW, seen
    assert got == want, (seen, got, want)
    lines = decode.kvferry_lines()
    assert "PD retract rebootstrap of rid" in lines and "asking the prefill server to recompute" in lines, lines
    assert "/generate answered 200" in lines, lines
    assert "failed" not in lines and "failed" not in prefill.kvferry_lines(), lines
