"""Where the benchmark's processes run, and how the two sides reach each other.

The prefill side (the bootstrap server, the prefill ranks, the raw senders)
always runs on this host. The decode side (decode ranks, the raw Mooncake
receiver, the socket-stream receiver) runs on a *decode host*: this one
(:class:`LocalHost`) or another node through its agent
(:class:`transfer.agent.AgentHost`). Both hand back :class:`Child`
objects with the same bounded waits, so every benchmark mode is written once.

A decode host runs only the commands named in :data:`COMMANDS`, with the
arguments given and extra environment variables named ``KVFERRY_*``,
``MC_*`` or ``UCX_*``.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata

from harness.launch import child_env

# Commands a decode host runs: name -> the interpreter's arguments before the caller's.
COMMANDS = {
    "workload-decode": ["-m", "harness.workload", "--role", "decode"],
    "mc-recv": ["-m", "benchmarks.raw", "mc-recv"],
    "sock-recv": ["-m", "benchmarks.raw", "sock-recv"],
    "nixl-recv": ["-m", "benchmarks.raw", "nixl-recv"],
}
# Commands that only run on this (the prefill) host.
LOCAL_COMMANDS = {
    "mc-send": ["-m", "benchmarks.raw", "mc-send"],
    "mc-pages": ["-m", "benchmarks.raw", "mc-pages"],
    "nixl-send": ["-m", "benchmarks.raw", "nixl-send"],
    "nixl-pages": ["-m", "benchmarks.raw", "nixl-pages"],
}
ENV_NAME = re.compile(r"^(KVFERRY|MC|UCX)_[A-Z0-9_]+$")
# Set per host from the Link, never forwarded from this host's environment.
_PER_HOST = ("KVFERRY_HOST", "KVFERRY_HOSTNAME", "KVFERRY_DEVICE_NAME")


@dataclass(frozen=True)
class Link:
    """The transport between the two sides and each side's addresses.

    ``hostname``/``peer_hostname``: the address of this (prefill) host and of
    the decode host as the other side reaches them (control sockets, the
    bootstrap server and Mooncake sessions); ``device``/``peer_device``:
    their RDMA NICs (empty: the engine picks)."""

    protocol: str = "tcp"
    hostname: str = "127.0.0.1"
    peer_hostname: str = "127.0.0.1"
    device: str = ""
    peer_device: str = ""

    def rank_env(self, decode: bool) -> dict[str, str]:
        """``KVFERRY_*`` for a workload rank (read by ``manager_config_from_env``)."""
        host, device = (self.peer_hostname, self.peer_device) if decode else (self.hostname, self.device)
        return {"KVFERRY_HOST": host, "KVFERRY_HOSTNAME": host, "KVFERRY_DEVICE_NAME": device}

    def engine_args(self, decode: bool) -> list[str]:
        """``benchmarks.raw`` arguments for a raw engine on one side."""
        host, device = (self.peer_hostname, self.peer_device) if decode else (self.hostname, self.device)
        return ["--hostname", host, "--protocol", self.protocol, "--device", device]


def forwarded_env() -> dict[str, str]:
    """This host's ``KVFERRY_*``, ``MC_*`` and ``UCX_*`` tuning variables, to apply on
    the decode host too (the per-host addresses excepted)."""
    return {k: v for k, v in os.environ.items() if ENV_NAME.match(k) and k not in _PER_HOST}


def machine() -> dict:
    """This host: CPUs, platform, and the versions that matter."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    versions = {}
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "torch", "nixl-cu12"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version(), "packages": versions}


class Child:
    """A process of the benchmark: its output (stdout and stderr together)
    and exit status. Every wait is bounded; a wait that runs out kills it."""

    poll_interval_s = 0.02

    def __init__(self, name: str) -> None:
        self.name = name
        self.output = ""

    # What a host provides.
    def _pull(self) -> int | None:
        """Append new output to ``self.output``; return the exit status
        (None while running). Output read after a non-None status is complete."""
        raise NotImplementedError

    def send_line(self, line: str) -> None:
        """Write one line to its stdin."""
        raise NotImplementedError

    def close_stdin(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        """Kill it now (idempotent)."""
        raise NotImplementedError

    # Shared.
    def wait_line(self, prefix: str, timeout_s: float) -> str:
        """The rest of the first output line starting with ``prefix``. Raises
        RuntimeError (with the output's tail) if the process exits without
        printing one or ``timeout_s`` runs out (it is then killed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            rc = self._pull()
            for line in self.output.splitlines(keepends=True):
                if line.endswith("\n") and line.startswith(prefix):
                    return line[len(prefix):].strip()
            if rc is not None:
                raise RuntimeError(f"{self.name} exited ({rc}) without printing {prefix!r}:\n{self.output[-2000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} printed no {prefix!r} in {timeout_s:.0f} s:\n{self.output[-2000:]}")
            time.sleep(self.poll_interval_s)

    def finish(self, timeout_s: float) -> tuple[int | None, str]:
        """Close its stdin, wait up to ``timeout_s`` for it to exit (then kill
        it); returns (exit status, None if killed; its whole output)."""
        self.close_stdin()
        deadline = time.monotonic() + max(0.1, timeout_s)
        rc = self._pull()
        while rc is None and time.monotonic() < deadline:
            time.sleep(self.poll_interval_s)
            rc = self._pull()
        if rc is None:
            self.kill()
            self._pull()
        return rc, self.output


class LocalChild(Child):
    """A child process on this host; output goes to an unnamed temporary file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        super().__init__(name)
        self._out = tempfile.TemporaryFile()
        self._offset = 0
        self.proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=self._out,
                                     stderr=subprocess.STDOUT, env={**child_env(), **env})
        self.pid = self.proc.pid

    def read_bytes(self, offset: int, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` of its output from ``offset`` (non-blocking)."""
        return os.pread(self._out.fileno(), max_bytes, offset)

    def returncode(self) -> int | None:
        return self.proc.poll()

    def _pull(self) -> int | None:
        rc = self.proc.poll()
        while chunk := self.read_bytes(self._offset, 1 << 20):
            self._offset += len(chunk)
            self.output += chunk.decode("utf-8", "replace")
        return rc

    def send_line(self, line: str) -> None:
        if self.proc.stdin is None or self.proc.stdin.closed:
            raise RuntimeError(f"{self.name}: its stdin is closed")
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def close_stdin(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:  # it exited already
                pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.close_stdin()

    def finish(self, timeout_s: float) -> tuple[int | None, str]:
        try:
            return super().finish(timeout_s)
        finally:
            self._out.close()

    def close(self) -> None:
        """Kill it if still running and drop its output file."""
        self.kill()
        self._out.close()


class LocalHost:
    """Runs the decode side (or any benchmark command) on this host."""

    name = "local"

    def spawn(self, command: str, args: list[str], env: dict[str, str] | None = None,
              lifetime_s: float = 3600.0) -> LocalChild:
        """Start ``command`` (see :data:`COMMANDS`) with ``args``. The caller
        bounds it with ``wait_line``/``finish``; ``lifetime_s`` is for the
        agent, which kills its children after it."""
        prefix = COMMANDS.get(command) or LOCAL_COMMANDS.get(command)
        if prefix is None:
            raise ValueError(f"unknown benchmark command {command!r}")
        return LocalChild(command, [*prefix, *args], env or {})

    def close(self) -> None:
        pass
