"""What the model-family vLLM tests share: kvferry's test connector config,
the server sets they start (a single-instance reference, a kvferry pair, and
vLLM's own NixlConnector pair where the honest reference is another
connector), running them for a module (ready, closed), the
decode metrics a run moved, and the digests the test connector logs
(``corrupting.py``: its lines' format is defined there).
"""

from __future__ import annotations

import contextlib
import re
import time
import urllib.error
import warnings

from harness.nixl_agents import connector as nixl_connector
from harness.vllm import Completion, ServerSpec, VLLMServer, complete, free_port, pd_complete

TEST_CONNECTOR = {"kv_connector": "CorruptingKvferryConnector",
                  "kv_connector_module_path": "tests.engines.vllm.corrupting"}
DIGEST_ENV = {"KVFERRY_TEST_DIGEST": "1"}


def kv_config(role: str, bootstrap: str, node: str, model_name: str, *, extra: dict | None = None,
              manager: dict | None = None) -> dict:
    """The test connector for ``role``; prefill serves the bootstrap server.
    ``extra``: more ``kv_connector_extra_config``; ``manager``: more ManagerConfig fields."""
    extra = {"kvferry_bootstrap_addr": bootstrap, "kvferry_node": node, **(extra or {}),
             "kvferry": {"bootstrap_timeout_s": 15, "transfer_timeout_s": 30, "model_name": model_name,
                         **(manager or {})}}
    if role == "kv_producer":
        extra["kvferry_serve_bootstrap"] = True
    return {**TEST_CONNECTOR, "kv_role": role, "kv_connector_extra_config": extra}


def kvferry_pair(model: str, root: str, bootstrap: str, node: str, model_name: str, *, args: tuple = (),
                 prefill_env: dict | None = None, prefill_args: tuple = (), prefill_kv: dict | None = None,
                 decode_kv: dict | None = None) -> dict[str, VLLMServer]:
    """Prefill (core 0) and decode (core 1) with the test connector, digests
    on; ``prefill_kv``/``decode_kv``: :func:`kv_config`'s ``extra`` and ``manager``."""
    prefill = kv_config("kv_producer", bootstrap, node, model_name, **(prefill_kv or {}))
    decode = kv_config("kv_consumer", bootstrap, node, model_name, **(decode_kv or {}))
    return {"prefill": VLLMServer(ServerSpec("prefill", model, 0, prefill, env={**DIGEST_ENV, **(prefill_env or {})},
                                             args=args + prefill_args), root),
            "decode": VLLMServer(ServerSpec("decode", model, 1, decode, env=DIGEST_ENV, args=args), root)}


def nixl_pair(model: str, root: str) -> dict[str, VLLMServer]:
    """vLLM's own NixlConnector pair on the same cores, its agents'
    progress threads not spinning (:func:`harness.nixl_agents.connector`:
    as vLLM ships it, each takes a core for the pair's whole life, from every
    server beside it on this 2-core machine)."""
    out = {}
    for side, core in (("prefill", 0), ("decode", 1)):
        config, env = nixl_connector(free_port())
        out[f"nixl-{side}"] = VLLMServer(ServerSpec(f"nixl-{side}", model, core, config, env=env), root)
    return out


#: how vLLM's NIXL worker logs a request failed by its handshake (``base_worker.py``, ``_log_failure``)
NIXL_HANDSHAKE_FAILED = "'failure_type': 'handshake_failed'"


def nixl_complete(servers: dict[str, VLLMServer], model: str, prompt: list[int], max_tokens: int) -> Completion:
    """:func:`pd_complete` through the NixlConnector pair, the reference.
    vLLM bounds a NIXL handshake's reply at a fixed 5 s and fails the request
    that met a slower one (``_nixl_handshake``: a ZMQ receive timeout, no
    retry); CI saw it twice on the pair's first request, a stall of a loaded
    2-core machine. A request failed so (decode logged ``handshake_failed``
    since it was sent) is sent again once, with a warning: the test compares
    kvferry's tokens to NixlConnector's, not NIXL's handshake to the machine's
    stalls. Any other failure is the test's."""
    prefill, decode = servers["nixl-prefill"], servers["nixl-decode"]
    seen = decode.log_tail(10_000_000).count(NIXL_HANDSHAKE_FAILED)
    try:
        return pd_complete(prefill, decode, model, prompt, max_tokens)
    except urllib.error.HTTPError as exc:
        if decode.log_tail(10_000_000).count(NIXL_HANDSHAKE_FAILED) == seen:
            raise
        warnings.warn(f"NixlConnector's decode failed its handshake (vLLM's fixed 5 s bound), sent again: {exc}",
                      stacklevel=2)
    return pd_complete(prefill, decode, model, prompt, max_tokens)


@contextlib.contextmanager
def running(servers: dict[str, VLLMServer], timeout_s: float = 300, *, shared: dict[str, VLLMServer] | None = None):
    """``servers`` once all serve, with ``shared`` (started by a wider
    fixture, maybe still starting: they start beside these); ``servers``
    are closed at the end, ``shared`` not. No request is made: each test's
    first PD request is its cluster's first, and is checked (a fresh pair
    opens its transport's way while the hello is answered, before any
    room: docs/transports.md, "Opening a peer")."""
    try:
        for server in (*servers.values(), *(shared or {}).values()):
            server.wait_ready(timeout_s)
        yield {**(shared or {}), **servers}
    finally:
        for server in servers.values():
            server.close()


def prompt_sources_since(server: VLLMServer, before: dict) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source`` per source since ``before`` (a ``metrics()``)."""
    after = server.metrics()
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def rank_digests(server: VLLMServer, side: str) -> dict[int, list[list[str]]]:
    """room -> the block digests each of ``side``'s ranks logged for it, in log order."""
    out: dict[int, list[list[str]]] = {}
    for m in re.finditer(rf"kvferry-test: digest side={side} room=(\d+) blocks=\d+ skip=\d+ sha=([0-9a-f,]+)",
                         server.log_tail(10_000_000)):
        out.setdefault(int(m.group(1)), []).append(m.group(2).split(","))
    return out


def logged(server: VLLMServer, side: str, rooms, ranks: int = 1, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until ``side``'s ``ranks`` ranks logged their digest of
    each of ``rooms``. Prefill logs a room's digest when its engine reports
    the room sent, at the engine's next step after the room ended, which can
    come after decode answered the request (CI: the last room of a run was
    missing from prefill's log when the test read it); decode logs before it
    computes, so before it answers. A room's group digests are logged before
    its digest, so they are there too."""
    rooms = set(rooms)
    deadline = time.monotonic() + timeout_s
    while True:
        found = rank_digests(server, side)
        missing = sorted(r for r in rooms if len(found.get(r, [])) < ranks)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.spec.name} logged no {side} digest of room(s) {missing} "
                                 f"({ranks} rank(s) each) within {timeout_s:g} s")
        time.sleep(0.2)


def digests(server: VLLMServer, side: str) -> dict[int, list[str]]:
    """room -> the block digests ``side`` (one rank) logged for it."""
    return {room: ranks[-1] for room, ranks in rank_digests(server, side).items()}


def group_digests(server: VLLMServer, side: str) -> dict[tuple[int, int], list[str]]:
    """(room, KV-cache group) -> that group's block digests by position (``-``: not held or wanted)."""
    return {(int(m.group(1)), int(m.group(2))): m.group(3).split(",")
            for m in re.finditer(rf"kvferry-test: group-digest side={side} room=(\d+) group=(\d+) sha=([0-9a-f,-]+)",
                                 server.log_tail(10_000_000))}


def idle_steps(server: VLLMServer) -> int:
    """The engine steps that computed nothing, as the test connector's
    worker last logged them (every 100th: the count is at most 99 behind)."""
    counts = re.findall(r"kvferry-test: idle-steps=(\d+)", server.log_tail(10_000_000))
    return int(counts[-1]) if counts else 0


def reported(servers, model: str) -> None:
    """Before a test reads its servers' kvferry numbers as a baseline: a
    room that ended after its server's last engine step is reported at the
    next step (a previous test's room, counted as the test's own). A plain request on each server makes those steps, and
    its answer comes after their numbers (the engine's outputs keep their order)."""
    for server in servers:
        complete(server, model, list(range(4, 24)), 2)


def settled_metric(server: VLLMServer, name: str, want: float, timeout_s: float = 10.0, **labels: str) -> float:
    """``server.gauge(name, **labels)``, read again until it reaches ``want`` or ``timeout_s``
    passed: a worker reports a room at its engine's next step after the
    room ended."""
    deadline = time.monotonic() + timeout_s
    while (value := server.gauge(name, **labels)) < want and time.monotonic() < deadline:
        time.sleep(0.2)
    return value
