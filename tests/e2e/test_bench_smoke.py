"""The benchmark runs and writes its JSON. It times nothing that a test
asserts on: throughput belongs to the benchmark, not to the test suite."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_bench_runs_all_three_modes_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "transfer.bench", "--only", "mha-128", "--requests", "4",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["transport"] == "tcp" and data["machine"]["cpus"] >= 1
    modes = sorted(r["mode"] for r in data["rows"])
    assert modes == ["kvferry", "limit", "limit", "mooncake"]
    for row in data["rows"]:
        for key in ("workload", "mode", "tokens", "concurrency", "bytes", "gbps", "p50_ms", "p99_ms",
                    "descriptors_per_request"):
            assert key in row, (key, row)
        assert row["workload"] == "mha-128" and row["tokens"] == 128 and row["bytes"] > 0
    kv = next(r for r in data["rows"] if r["mode"] == "kvferry")
    # 128 tokens of 32 layers x K/V: 64 contiguous-page descriptors and the aux row.
    assert kv["descriptors_per_request"] == 65
    assert kv["bytes"] == 4 * 128 * 32 * 2 * 8 * 128 * 2
    assert "kvferry" in proc.stdout and "of mooncake" in proc.stdout
