"""Long-lived rank processes driven over stdin (:mod:`harness.rankctl`),
with every wait bounded: the fault tests' ranks, and the cold-start
benchmark's fresh pairs."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time

from harness.forkserver import spawn_module
from harness.launch import child_env
from harness.workload import Spec


class Rank:
    """One ``harness.rankctl`` process."""

    def __init__(self, role: str, spec: Spec, config: dict | None = None, env: dict | None = None,
                 start_timeout_s: float = 60.0) -> None:
        self.role = role
        e = child_env()
        e.update(env or {})
        self.proc = spawn_module(
            "harness.rankctl", ["--role", role, "--spec", spec.to_json(), "--config", json.dumps(config or {})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._wait("READY ", start_timeout_s)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _wait(self, prefix: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.01, left))
            except queue.Empty:
                line = ""
            if line is None or (not line and left <= 0):
                raise AssertionError(f"{self.role} rank: no {prefix.strip()} within {timeout_s:g} s "
                                     f"(exit {self.proc.poll()}):\n" + "".join(self.log[-40:]))
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])
            if line:
                self.log.append(line)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float = 90.0) -> dict:
        r = self._wait("REPLY ", timeout_s)
        assert "crash" not in r, f"{self.role} rank crashed: {r['crash']}\n" + "".join(self.log[-40:])
        return r

    def event(self, timeout_s: float = 30.0) -> dict:
        """The next ``EVENT`` line the running command prints (``announce_requested``)."""
        return self._wait("EVENT ", timeout_s)

    def rooms(self, rooms, timeout_s: float = 60.0, **opts) -> dict:
        self.send(op="rooms", rooms=list(rooms), timeout_s=timeout_s, **opts)
        return self.reply(timeout_s + 30)

    def stats(self) -> dict:
        self.send(op="stats")
        return self.reply(30)

    def kill(self, sig=signal.SIGKILL) -> float:
        """Send ``sig``; returns the wall-clock time it was sent."""
        t = time.time()
        os.kill(self.proc.pid, sig)
        return t

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.send(op="exit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired, BrokenPipeError, ValueError):
                self.proc.kill()
                self.proc.wait(10)
