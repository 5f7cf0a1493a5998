"""Helpers for the fault tests: long-lived rank processes driven over stdin
(:mod:`harness.rankctl`), with every wait bounded."""

from __future__ import annotations

from harness.ranks import Rank  # noqa: F401  (the tests import it from here)
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
