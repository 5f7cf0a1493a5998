"""``python -m benchmarks.bootstrap_load`` runs, stops by itself and reports
what it measured (a small, short run)."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.transport_free]


def test_bootstrap_load_smoke():
    out = subprocess.run([sys.executable, "-m", "benchmarks.bootstrap_load", "--ranks", "32", "--layers", "4",
                          "--steps", "200,400", "--step-s", "1", "--lookup-rate", "300", "--duration-s", "4",
                          "--clients", "1", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["ranks_registered_at_start"] == 32
    assert [s["target_rate"] for s in result["steps"]] == [200, 400]
    for step in result["steps"]:
        assert step["answered"] > 0.5 * step["target_rate"] and step["ready"] == step["answered"]
        assert step["unknown_node"] == step["error"] == 0 and step["p50_ms"] > 0
    main = result["main"]
    assert main["restart_s"] > 0 and main["unknown_node"] == 0 and main["error"] == 0
    assert main["ready"] > 0 and main["answered"] + main["lost"] == main["sent"]
    assert result["registrations"]["answered"] > 32 and result["registrations"]["errors"] == 0
