"""Start the processes of one SGLang PD run and read what they report (tests and benchmark)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.forkserver import PRELOAD_ENV, spawn_module
from harness.ports import free_port, free_ports

# A config.json-only model: SGLang's own backends read the model config at start-up.
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
                "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8,
                "num_hidden_layers": 3, "vocab_size": 1000, "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
ROOT = Path(__file__).resolve().parents[3]
STUBS = Path(__file__).resolve().parent / "stubs"
# Imported once by the fork server the ranks fork from (harness/forkserver.py, where the suite turns it on):
# SGLang costs about 15 CPU-s per process to import on two cores, most of a run.
PRELOAD = "sglang.srt.server_args,sglang.srt.disaggregation.utils,sglang.srt.mem_cache.memory_pool"


def model_config(extra_args) -> dict:
    """MODEL_CONFIG with the geometry ``rank.py``'s ``--layers/--heads/--head-dim`` ask for (a decode
    rank reads the model's KV heads from it, as SGLang's decode does)."""
    geometry = dict(a.lstrip("-").split("=", 1) for a in extra_args if a.startswith("--") and "=" in a)
    heads = int(geometry.get("heads", MODEL_CONFIG["num_key_value_heads"]))
    return {**MODEL_CONFIG, "num_key_value_heads": heads, "num_attention_heads": heads,
            "head_dim": int(geometry.get("head-dim", MODEL_CONFIG["head_dim"])),
            "num_hidden_layers": int(geometry.get("layers", MODEL_CONFIG["num_hidden_layers"]))}


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(STUBS)])
    env.setdefault("KVFERRY_PROTOCOL", "tcp")
    env.setdefault("KVFERRY_STAGING_BYTES", str(8 << 20))
    env.setdefault("KVFERRY_STAGE_PART_BYTES", str(4 << 20))
    env.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    env.setdefault("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "60")
    env.setdefault("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "60")
    env.setdefault(PRELOAD_ENV, PRELOAD)
    env.update(extra or {})
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen  # or harness.forkserver's handle of a forked rank
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    log: list = field(default_factory=list)
    taken: dict = field(default_factory=dict)

    def events(self, kind: str) -> list[dict]:
        # An event is one write (rank.emit), but a log line another thread wrote in
        # pieces may end on it: only the event's object is read.
        return [json.JSONDecoder().raw_decode(line.split(" ", 1)[1])[0] for line in self.log
                if line.startswith(kind + " ")]

    def wait_for(self, kind: str, timeout_s: float) -> dict:
        """The next not yet taken line of ``kind`` (every line read is kept in
        ``log``); TimeoutError with the log tail."""
        deadline = time.monotonic() + timeout_s
        while True:
            found, n = self.events(kind), self.taken.get(kind, 0)
            if len(found) > n:
                self.taken[kind] = n + 1
                return found[n]
            exited = self.popen.poll() is not None and self.lines.empty()
            if exited or time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no {kind} within {timeout_s:g} s (exit {self.popen.poll()}); "
                                   "last output:\n" + "\n".join(self.log[-25:]))
            try:
                self.log.append(self.lines.get(timeout=0.2))
            except queue.Empty:
                pass

    def drain(self, timeout_s: float) -> None:
        """Read until the process exits or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.log.append(self.lines.get(timeout=0.2))
            except queue.Empty:
                if self.popen.poll() is not None:
                    return

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:  # a forked rank not yet leading its group
                self.popen.kill()
            self.popen.wait(timeout=10)


def start(name: str, args: list[str], env: dict) -> Proc:
    popen = spawn_module("tests.engines.sglang.rank", args, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=str(ROOT),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc = Proc(name, popen)

    def pump():
        for line in popen.stdout:
            proc.lines.put(line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    return proc


@dataclass
class Run:
    """A bootstrap server, ``prefill_tp`` prefill ranks and ``decode_tp`` decode ranks."""

    scenario: str
    pool: str = "mha"
    draft: bool = False
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_dp: int = 1  # attention DP: the TP ranks split into this many groups
    decode_dp: int = 1
    backend: str = "kvferry"
    env: dict = field(default_factory=dict)
    timeout_s: float = 120.0
    extra_args: list = field(default_factory=list)  # geometry etc., see rank.py
    procs: list = field(default_factory=list)

    def __enter__(self) -> Run:
        env = child_env({"KVFERRY_SGLANG_BOOTSTRAP_PORT": str(free_port()), **self.env})
        port = free_port()
        pgloo, dgloo = free_ports(self.prefill_dp), free_ports(self.decode_dp)
        self._model = tempfile.TemporaryDirectory(prefix="sglang-model-")
        (Path(self._model.name) / "config.json").write_text(json.dumps(model_config(self.extra_args)))
        common = ["--backend", self.backend, "--port", str(port), "--pool", self.pool, "--scenario", self.scenario,
                  "--timeout", str(self.timeout_s), "--model-dir", self._model.name] + \
            (["--draft"] if self.draft else []) + list(self.extra_args)
        try:
            self.bootstrap = start("bootstrap", ["--role", "bootstrap", *common], env)
            self.procs.append(self.bootstrap)
            self.bootstrap.wait_for("READY", self.timeout_s)
            self.prefill = [start(f"prefill{r}", ["--role", "prefill", "--tp-rank", str(r), "--tp-size",
                                                  str(self.prefill_tp), "--dp-size", str(self.prefill_dp),
                                                  "--gloo-port", str(pgloo), *common], env)
                            for r in range(self.prefill_tp)]
            self.procs += self.prefill
            self.decode = [start(f"decode{r}", ["--role", "decode", "--tp-rank", str(r), "--tp-size",
                                                str(self.decode_tp), "--dp-size", str(self.decode_dp),
                                                "--gloo-port", str(dgloo), *common], env)
                           for r in range(self.decode_tp)]
            self.procs += self.decode
        except BaseException:
            self.close()
            raise
        return self

    def finish(self) -> None:
        """Wait (bounded) for every rank's DONE line; on a timeout, the error
        shows what every rank printed last (a stuck room shows on its peers)."""
        for p in self.prefill + self.decode:
            try:
                p.wait_for("DONE", self.timeout_s)
            except TimeoutError as exc:
                for q in self.prefill + self.decode:  # what they printed and nobody read yet
                    while not q.lines.empty():
                        q.log.append(q.lines.get_nowait())
                others = "\n".join(f"--- {q.name}:\n" + "\n".join(q.log[-15:])
                                   for q in self.prefill + self.decode if q is not p)
                raise TimeoutError(f"{exc}\n{others}") from None

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        if getattr(self, "_model", None) is not None:
            self._model.cleanup()

    def __exit__(self, *exc) -> None:
        self.close()
