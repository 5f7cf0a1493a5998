"""Start a bootstrap server and scripted prefill/decode ranks as separate
processes on this machine, and collect their results. Used by ``make demo``,
the end-to-end tests and the benchmark.

Every wait is bounded: a process tree that outlives ``timeout_s`` is killed
and reported, never waited on forever.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

from harness.forkserver import spawn_module
from harness.workload import Spec


# The repository root: the harness, the benchmark and the examples are not
# installed, so a child started from another directory finds them here.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env() -> dict[str, str]:
    """This process's environment for a rank or server process, with the
    repository on ``PYTHONPATH`` (``python -m harness.workload`` works from
    any directory). ``KVFERRY_TEST_TRANSPORT=nixl`` runs the ranks on NIXL
    (``KVFERRY_BACKEND``), with UCX on the loopback device."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO_ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, *paths])
    env.setdefault("OMP_NUM_THREADS", "1")  # two cores shared by several ranks
    transport = env.get("KVFERRY_TEST_TRANSPORT", "")
    if transport:  # the whole multi-process suite on another transport (make test-nixl)
        env.setdefault("KVFERRY_BACKEND", transport)
    if env.get("KVFERRY_BACKEND") == "nixl":
        env.setdefault("UCX_NET_DEVICES", "lo")  # UCX listens on loopback only, as every test server does
    return env


class BootstrapProcess:
    """``python -m bootstrap`` (or ``module``) on a free loopback port (or
    ``port``), started under ``prefix`` (e.g. ``ip netns exec NS``);
    ``address`` once it listens, within ``timeout_s``. ``secret`` turns
    authentication on ("" off; None: as this process's environment says)."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 20.0, *, port: int = 0,
                 secret: str | None = None, extra_args: tuple[str, ...] = (), prefix: tuple[str, ...] = (),
                 module: str = "bootstrap") -> None:
        self._log = tempfile.TemporaryFile()
        env = child_env()
        if secret is not None:
            env.pop("KVFERRY_SECRET", None)
            if secret:
                env["KVFERRY_SECRET"] = secret
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", module, "--host", host, "--port", str(port),
                                      "--log-level", "WARNING", *extra_args],
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        line = ""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if sel.select(timeout_s):
                line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.close()
            raise RuntimeError(f"the bootstrap server did not start within {timeout_s:g} s: {line!r}")
        self.address = line.split()[-1]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()
        self._log.close()

    def __enter__(self) -> BootstrapProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class RankRun:
    role: str
    tp_rank: int
    returncode: int | None
    result: dict | None
    log: str


def start_ranks(spec: Spec, role: str, args: list[str],
                env: dict[str, str] | None = None) -> tuple[subprocess.Popen, tempfile.TemporaryFile]:
    """Start ``python -m harness.workload`` for ``role``; ``env`` adds to
    :func:`child_env` (``KVFERRY_HOST``, ... for another address)."""
    out = tempfile.TemporaryFile(mode="w+")
    proc = spawn_module("harness.workload", ["--role", role, *args, "--spec", spec.to_json()],
                        stdout=out, stderr=subprocess.STDOUT, text=True, env={**child_env(), **(env or {})})
    return proc, out


def results_of(log: str, role: str, returncode: int | None) -> list[RankRun]:
    """One RankRun per RESULT line in a workload process's output (one per
    rank it ran); a single one without a result if it printed none."""
    results = [json.loads(line[len("RESULT "):]) for line in log.splitlines() if line.startswith("RESULT ")]
    if not results:
        return [RankRun(role, -1, returncode, None, log)]
    return [RankRun(role, r["tp_rank"], returncode, r, log) for r in results]


def collect(proc: subprocess.Popen, out, deadline: float, *, dump_first: bool = False) -> str:
    """Wait for ``proc`` until ``deadline`` (then kill it); its output,
    written to the temporary file ``out``, which is closed. ``dump_first``:
    a process that registered SIGUSR1 with faulthandler (the example nodes)
    is sent it first and given a second to print its threads' stacks into
    its output, so that a hang says where it was."""
    try:
        proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        if dump_first:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        proc.kill()
        proc.wait(5)
    out.seek(0)
    log = out.read()
    out.close()
    return log


def finish_ranks(proc, out, role: str, deadline: float) -> list[RankRun]:
    """One RankRun per RESULT line the process printed (one per rank it ran);
    a single one without a result if it printed none."""
    return results_of(collect(proc, out, deadline), role, proc.returncode)


def run_pd(spec: Spec, *, timeout_s: float = 300.0, bootstrap: str | None = None,
           rank_processes: bool = True) -> list[RankRun]:
    """Run every prefill and decode rank of ``spec`` to completion (or kill
    them at ``timeout_s``); starts a bootstrap server unless given one.

    ``rank_processes``: one process per rank, as in production; otherwise one
    process per role running its ranks as threads (cheaper on small machines;
    prefill and decode are separate processes either way)."""
    owned = None
    if bootstrap is None:
        owned = BootstrapProcess()
        bootstrap = owned.address
    spec = replace(spec, bootstrap=bootstrap)
    try:
        if rank_processes:
            procs = [("prefill", *start_ranks(spec, "prefill", ["--tp-rank", str(t), "--dp-rank", str(d)]))
                     for d in range(spec.prefill_dp) for t in range(spec.prefill_tp)]
            procs += [("decode", *start_ranks(spec, "decode", ["--tp-rank", str(t)])) for t in range(spec.decode_tp)]
        else:
            procs = [(role, *start_ranks(spec, role, ["--all-ranks"])) for role in ("prefill", "decode")]
        deadline = time.monotonic() + timeout_s
        return [run for role, p, out in procs for run in finish_ranks(p, out, role, deadline)]
    finally:
        if owned is not None:
            owned.close()
