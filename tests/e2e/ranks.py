"""Helpers for the fault tests: long-lived rank processes driven over stdin
(:mod:`harness.rankctl`), with every wait bounded."""

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
from harness.workload import PoolSpec, Spec

# 4 layers of 8 KV heads x 128 x bf16: 16 KiB per token; rooms of 2k tokens
# (32 MiB) sent in 8 chunks, so a fault can land in the middle of one.
MODEL = PoolSpec(role="target", attention="mha", num_layers=4, total_heads=8, head_dim=128)


def fault_spec(bootstrap: str, **kw) -> Spec:
    base = dict(bootstrap=bootstrap, prefill_pools=(MODEL,), decode_pools=(MODEL,), page_size=16,
                prefill_pages=256, decode_pages=640, aux_slots=64, min_tokens=2048, max_tokens=2048,
                chunk_pages=16, page_placement="scattered", timeout_s=30.0, seed=99)
    base.update(kw)
    return Spec(**base)


# The fault tests' settings: a peer is given up after 2 s of silence, and
# staged rooms go in 16 MiB parts (a 64 MiB room in four), so that a fault
# or an abort can land between the parts of one room.
FAST = {"peer_timeout_s": 2.0, "heartbeat_interval_s": 0.25, "register_interval_s": 0.5,
        "stage_part_bytes": 16 << 20, "layerwise_min_tokens": 0}  # short rooms: layer groups stream anyway


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


def assert_all_success(res: dict, rooms) -> None:
    got = res["results"]
    assert sorted(int(k) for k in got) == sorted(rooms), got
    for room, r in got.items():
        assert r["state"] == "Success", f"room {room}: {r}"
        assert r.get("mismatches", []) == [], f"room {room}: {r['mismatches']}"


def assert_failed_within(res: dict, since: float, bound_s: float, error_types=None) -> list:
    """Every room not already successful failed (not stuck) within ``bound_s`` of ``since``."""
    failed = []
    for room, r in res["results"].items():
        assert r["state"] in ("Success", "Failed"), f"room {room} did not end: {r}"
        if r["state"] == "Failed":
            failed.append(int(room))
            assert r["ended_at"] - since <= bound_s, \
                f"room {room} failed {r['ended_at'] - since:.1f} s after the fault (bound {bound_s} s): {r}"
            if error_types:
                assert r["error_type"] in error_types, f"room {room}: {r}"
            assert r["error"], f"room {room}: no failure message"
    if failed:  # for the record (pytest -s): how long after the fault the last room ended
        print(f"  {len(failed)} rooms failed, the last {max(r['ended_at'] for r in res['results'].values() if r['state'] == 'Failed') - since:.2f} s after the fault")
    return failed
