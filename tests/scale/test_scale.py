"""The scale test's small version (``python -m harness.scale --quick``):
4 waves of 256 rooms in flight between one prefill and one decode rank, then 4 prefill
ranks in 2 processes feeding 2 decode ranks with random arrivals and aborts;
real processes, real Mooncake over TCP loopback, every byte checked, and
threads, descriptors and memory flat from the first quarter to the last.
``make test-scale`` runs this file (CI does, after ``make test``); ``make scale``
runs the full size."""

import json
import subprocess
import sys

import pytest

from harness.launch import child_env

pytestmark = pytest.mark.e2e


def test_scale_quick_every_room_accounted_for_and_resources_flat(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, "-m", "harness.scale", "--quick", "--timeout-s", "240", "--json", str(out)],
                          capture_output=True, text=True, timeout=560, env=child_env())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    one, many = report["one-to-one"], report["many"]
    assert one["problems"] == [] and many["problems"] == []
    # Every room ended on both sides; all of them were in flight at once in the first phase.
    assert one["roles"]["decode"]["success"] == one["roles"]["prefill"]["success"] == 4 * 256
    assert one["roles"]["decode"]["max_live_per_manager"] == 256
    dec, pre = many["roles"]["decode"], many["roles"]["prefill"]
    assert dec["rooms"] == pre["rooms"] == 400
    aborted = dec["aborted_failed"] + dec["aborted_success"]
    assert 0 < aborted < 600 and dec["success"] == 400 - dec["aborted_failed"]
    # Bytes checked: each decode success counts its pages' bytes.
    assert dec["gb"] > 0 and dec["cpu_ms_per_room"] > 0
    assert len(pre["processes"]) == 2 and all(p["managers"] == 2 for p in pre["processes"])
