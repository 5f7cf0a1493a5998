"""vLLM's KV layouts through kvferry, end to end: a real bootstrap server
process, one prefill and one decode process (each hosting its side's TP
ranks, one KVManager and Mooncake engine per rank), real Mooncake over TCP on
loopback. Random data, random block lists; decode compares its whole buffer
byte for byte with what it must hold (the received blocks in place, every
other byte, other layers' pages of cross-layer blocks included, unchanged).

One process pair serves the whole matrix (:mod:`tests.layouts.layout_rank`), so
it costs one start-up. Layouts (vLLM 0.32's ``KVCacheLayout`` names): the CPU
backend's ``LBHNC`` with K rows then V rows (``fused_rows``), and the GPU
backends' ``LBHNC``, ``LBNHC``, ``BLHNC``, ``BLNHC`` (``fused_cells``), with
prefill TP 2 -> decode TP 1 and 1 -> 2, direct writes and staged ones, and
the connector's worker half (``KvferryWorker``) driven as vLLM drives it.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from dataclasses import asdict

import pytest

from harness.launch import BootstrapProcess, child_env
from tests.layouts.layout_rank import Case


class Side:
    """One ``tests.layouts.layout_rank`` process; every wait bounded."""

    def __init__(self, role: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.layouts.layout_rank", "--role", role],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=child_env())
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self._wait("READY", 60.0)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _wait(self, prefix: str, timeout_s: float) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"no {prefix} within {timeout_s} s:\n{''.join(self.log[-40:])}") from None
            if line is None:
                raise AssertionError(f"process exited before {prefix}:\n{''.join(self.log[-40:])}")
            self.log.append(line)
            if line.startswith(prefix):
                return line[len(prefix):].strip()

    def submit(self, case: Case) -> None:
        self.proc.stdin.write(json.dumps(asdict(case)) + "\n")
        self.proc.stdin.flush()

    def registered(self, timeout_s: float) -> None:
        """Wait for the prefill side's ranks to be registered (or its result, if it failed first)."""
        while True:
            line = self._wait("", timeout_s)
            if line.startswith("REGISTERED"):
                return
            if line.startswith("RESULT "):
                self.lines.put(line + "\n")  # read again by result()
                return

    def result(self, timeout_s: float) -> dict:
        return json.loads(self._wait("RESULT ", timeout_s))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def sides():
    with BootstrapProcess() as server:
        prefill, decode = Side("prefill"), Side("decode")
        try:
            yield server.address, prefill, decode
        finally:
            prefill.close()
            decode.close()


def run_case(sides, **kw) -> tuple[dict, dict]:
    addr, prefill, decode = sides
    case = Case(bootstrap=addr, node=f"layout-{kw['name']}", **kw)
    prefill.submit(case)
    prefill.registered(case.timeout_s)  # the prefill node is known before decode looks it up
    decode.submit(case)
    return prefill.result(case.timeout_s + 30), decode.result(case.timeout_s + 30)


# name, vLLM layout, packing, prefill TP, decode TP, staged, extra
MATRIX = [
    ("cpu-1to1", "LBHNC", "fused_rows", 1, 1, True, {}),
    ("cpu-2to1", "LBHNC", "fused_rows", 2, 1, False, {}),
    ("cpu-1to2", "LBHNC", "fused_rows", 1, 2, True, {}),
    ("hnd-1to1", "LBHNC", "fused_cells", 1, 1, False, {}),
    ("nhd-1to1", "LBNHC", "fused_cells", 1, 1, True, {}),
    ("nhd-2to1", "LBNHC", "fused_cells", 2, 1, False, {}),
    ("nhd-1to2", "LBNHC", "fused_cells", 1, 2, True, {}),
    ("cross-hnd-1to1", "BLHNC", "fused_cells", 1, 1, False, {}),
    ("cross-hnd-2to1", "BLHNC", "fused_cells", 2, 1, True, {}),
    ("cross-nhd-1to2", "BLNHC", "fused_cells", 1, 2, False, {}),
    ("cross-to-per-layer", "BLHNC", "fused_cells", 1, 1, False, {"decode_layout": "LBHNC"}),
    ("worker-cpu-2to1", "LBHNC", "fused_rows", 2, 1, False, {"driver": "worker"}),
    ("worker-cpu-1to2", "LBHNC", "fused_rows", 1, 2, False, {"driver": "worker"}),
]


def test_vllm_layouts_byte_exact(sides):
    """The whole matrix in one process pair (one start-up); every case must pass."""
    failures = []
    for seed, (name, layout, packing, ptp, dtp, staged, extra) in enumerate(MATRIX, start=11):
        p, d = run_case(sides, name=name, layout=layout, kv_layout=packing, prefill_tp=ptp, decode_tp=dtp,
                        seed=seed, staged=staged, **extra)
        if p["failed"] or d["failed"] or d.get("mismatches"):
            failures.append(f"{name}: prefill {p}, decode {d}")
            continue
        assert d["bytes"] > 0 and d["rooms"] == 4 * dtp and p["rooms"] == 4 * ptp, (name, p, d)
    assert not failures, "\n".join(failures)


def test_unbridgeable_layouts_fail_naming_both(sides):
    """vLLM's CPU blocks (K rows then V rows) and a GPU backend's LBHNC blocks
    (K then V per token) have the same shape and strides but cannot be
    bridged: decode's rooms fail with the typed error naming both layouts,
    and no byte of decode's buffer changes."""
    p, d = run_case(sides, name="mismatch", layout="LBHNC", kv_layout="fused_rows", prefill_tp=1, decode_tp=1,
                    seed=5, staged=False, decode_kv_layout="fused_cells", timeout_s=4.0, expect_moved=False)
    assert d["failed"], d
    text = " ".join(d["failed"])
    assert "kv_layout" in text and "vLLM CPU (LBHNC, K rows then V rows)" in text and "vLLM LBHNC" in text, text
    assert p["failed"], p  # no decode ever asked: prefill's rooms time out
    assert d["mismatches"] == [] and d["bytes"] > 0
