"""End-to-end fixtures: real bootstrap server process, real prefill and decode
processes, real Mooncake engine over TCP on loopback."""

import pytest

from harness.launch import BootstrapProcess


@pytest.fixture
def bootstrap_server():
    with BootstrapProcess() as server:
        yield server


def assert_all_succeeded(runs, num_rooms):
    """Every rank ran every room to Success, and decode found every byte right."""
    for run in runs:
        assert run.result is not None, f"{run.role} {run.tp_rank} printed no result:\n{run.log[-3000:]}"
        r = run.result
        assert r["failed"] == [], f"{run.role} {run.tp_rank} failed rooms: {r['failed'][:3]}\n{run.log[-2000:]}"
        assert r["mismatches"] == [], f"{run.role} {run.tp_rank}: {r['mismatches'][:5]}"
        assert r["rooms"] == r["success"] == num_rooms
        assert run.returncode == 0, run.log[-2000:]
    decode = [r.result for r in runs if r.role == "decode"]
    assert all(d["bytes"] > 0 for d in decode), "decode verified no bytes"
