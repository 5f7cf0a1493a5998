"""End-to-end fixtures: real bootstrap server process, real prefill and decode
processes, real Mooncake engine over TCP on loopback (or NIXL, with
``KVFERRY_TEST_TRANSPORT=nixl``: ``make test-nixl``)."""

import os

import pytest

from harness.launch import BootstrapProcess


@pytest.fixture
def bootstrap_server():
    with BootstrapProcess() as server:
        yield server


def assert_all_succeeded(runs, num_rooms):
    """Every rank ran every room to Success, and decode found every byte right."""
    for run in runs:
        assert run.result is not None, f"{run.role} {run.tp_rank} printed no result:\n{_tails(runs)}"
        r = run.result
        assert r["failed"] == [], f"{run.role} {run.tp_rank} failed rooms: {r['failed'][:3]}\n{_tails(runs)}"
        assert r["mismatches"] == [], f"{run.role} {run.tp_rank}: {r['mismatches'][:5]}"
        assert r["rooms"] == r["success"] == num_rooms
        assert run.returncode == 0, run.log[-2000:]
    decode = [r.result for r in runs if r.role == "decode"]
    assert all(d["bytes"] > 0 for d in decode), "decode verified no bytes"
    expected = e2e_transport()
    assert all(r.result.get("transport") == expected for r in runs), \
        f"ranks ran on {[r.result.get('transport') for r in runs]}, not {expected}"


def _tails(runs, num_chars: int = 2500) -> str:
    """The end of every process's output (each side's view of a failure:
    a room stuck on one side is explained by the other)."""
    logs = {id(run.log): (run.role, run.log) for run in runs}
    return "\n".join(f"--- {role} process:\n{log[-num_chars:]}" for role, log in logs.values())


def e2e_transport() -> str:
    """The transport the multi-process tests run on (``KVFERRY_TEST_TRANSPORT``)."""
    return os.environ.get("KVFERRY_TEST_TRANSPORT", "") or "mooncake"


#: tests that poke one engine's internals skip on the others
def only_on(transport: str, why: str):
    return pytest.mark.skipif(e2e_transport() != transport, reason=f"{transport} only: {why}")
