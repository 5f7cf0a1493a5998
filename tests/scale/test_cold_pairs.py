"""Fresh pairs (issue 39): 52 NEW prefill -> decode process pairs, each with
the default ``ManagerConfig`` and Mooncake over TCP on loopback, a quarter
each with nothing, a connect-and-close every 100 ms, one and two idle
connections on decode's handshake port (:mod:`harness.cold_pairs`). Each
pair's first room (its lookup and handshake included) and second room
succeed byte-exact, the first rooms' p99 under 1 s; prefill's scheduler
calls never wait on a handshake (the longest under 100 ms, where a held
handshake took 5 s and more). Two pairs run at a time."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.cold_pairs import VARIANTS, run_pair, summarize
from harness.launch import BootstrapProcess

pytestmark = pytest.mark.e2e

NUM_PAIRS = 52


def test_fifty_fresh_pairs_first_rooms_land_within_a_second_whatever_holds_the_handshake_port(monkeypatch):
    monkeypatch.setenv("KVFERRY_FORKSERVER", os.environ.get("KVFERRY_FORKSERVER", "1"))
    with BootstrapProcess() as server, ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_pair, server.address, i, VARIANTS[i % len(VARIANTS)]) for i in range(NUM_PAIRS)]
        pairs = [j.result(timeout=300) for j in jobs]
    rows = summarize(pairs)
    for r in rows:
        print(f"  {r['variant']} {r['room']}: n={r['num']} failed={r['failed']} "
              f"min/median/p99/max {r['min_s']:.3f}/{r['median_s']:.3f}/{r['p99_s']:.3f}/{r['max_s']:.3f} s, "
              f"prefill's longest call {r['prefill_max_call_s'] * 1e3:.1f} ms "
              f"(held {r['prefill_max_held_s'] * 1e3:.1f} ms): {r['prefill_slowest_calls'][:3]}")
    assert all(r["failed"] == 0 for r in rows), [r["errors"] for r in rows if r["failed"]]
    firsts = sorted(p["rooms"][0]["latency_s"] for p in pairs)
    assert len(firsts) == NUM_PAIRS
    p99 = firsts[min(len(firsts) - 1, round(0.99 * (len(firsts) - 1)))]
    assert p99 < 1.0, f"first rooms' p99 {p99:.3f} s: {firsts[-5:]}"
    assert all(p["neighbour_connects"] > 0 for p in pairs if p["variant"] != "none")
    assert max(r["prefill_max_call_s"] for r in rows) < 0.1
