"""A rank's Prometheus /metrics, scraped over HTTP from a real prefill and a
real decode process (real bootstrap server, Mooncake over TCP) after real
rooms: bytes are exactly pages x page bytes, staged parts and descriptors
agree between the sides and with the transport, rooms are counted by final
state, and an abort shows with its reason on both sides."""

from __future__ import annotations

import urllib.request

import pytest

from harness.launch import BootstrapProcess
from harness.ports import free_port

from .ranks import FAST, MODEL, Rank, assert_all_success, fault_spec

pytestmark = pytest.mark.e2e
parser = pytest.importorskip("prometheus_client.parser")

# Bytes of one page of MODEL: K and V of every layer, every head, bf16.
PAGE_BYTES = 16 * MODEL.total_heads * MODEL.head_dim * 2 * MODEL.num_layers * 2


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in parser.text_string_to_metric_families(text) for s in fam.samples}


def _sum(got: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in got.items() if n == name and labels.items() <= dict(ls).items())


def _both(prefill, decode, rooms, p_opts=None):
    prefill.send(op="rooms", rooms=list(rooms), timeout_s=60, **(p_opts or {}))
    decode.send(op="rooms", rooms=list(rooms), timeout_s=60)
    return prefill.reply(), decode.reply()


def test_rank_metrics_match_what_moved():
    with BootstrapProcess() as server:
        spec = fault_spec(server.address)
        env = {"KVFERRY_LOG_LEVEL": "WARNING"}  # rankctl's own default is ERROR
        prefill = Rank("prefill", spec, {**FAST, "metrics_port": free_port()}, env=env)
        # Unfenced, so the aux row is an engine write counted on both sides (a fenced decode
        # gets it in RoomStatus, which prefill's stats do not count as aux bytes moved).
        decode = Rank("decode", spec, {**FAST, "metrics_port": free_port(), "write_fence": False}, env=env)
        try:
            ports = {"prefill": prefill.ready["metrics_port"], "decode": decode.ready["metrics_port"]}
            assert all(ports.values()), ports
            rooms = [1, 2, 3]
            p, d = _both(prefill, decode, rooms)
            assert_all_success(p, rooms)
            assert_all_success(d, rooms)
            pages = sum(r["pages"] for r in d["results"].values())
            sent = prefill.stats()["bytes_sent"]  # the transport's own count
            got = {side: _scrape(port) for side, port in ports.items()}
            for side, m in got.items():
                assert _sum(m, "kvferry_bytes_total", role=side, pool="target") == pages * PAGE_BYTES, side
                assert _sum(m, "kvferry_bytes_total", role=side, pool="aux") == len(rooms) * spec.aux_slot_bytes
                assert _sum(m, "kvferry_bytes_total", role=side, pool="draft") == 0
                assert _sum(m, "kvferry_rooms_total", role=side, state="Success") == len(rooms)
                assert _sum(m, "kvferry_rooms_total", role=side, state="Failed") == 0
                assert _sum(m, "kvferry_room_seconds_count", role=side) == len(rooms)
                assert 0 < _sum(m, "kvferry_room_seconds_sum", role=side) < 60 * len(rooms)
                assert _sum(m, "kvferry_room_first_byte_seconds_count", role=side) == len(rooms)
                assert _sum(m, "kvferry_live_rooms", role=side) == 0
                assert _sum(m, "kvferry_control_messages_received_total", role=side) > 0
                assert _sum(m, "kvferry_control_messages_dropped_total", role=side) == 0
                assert _sum(m, "kvferry_staging_bytes_in_use", role=side) == 0
                assert _sum(m, "kvferry_staging_capacity_bytes", role=side) > 0
            # Scattered pages go staged: parts agree between the sides, and
            # prefill's bytes are the transport's.
            pm, dm = got["prefill"], got["decode"]
            parts = _sum(pm, "kvferry_staged_parts_total")
            assert parts > 0 and _sum(dm, "kvferry_staged_parts_total") == parts
            assert _sum(pm, "kvferry_bytes_total", path="staged") == pages * PAGE_BYTES
            assert _sum(pm, "kvferry_descriptors_total", path="staged") == parts
            assert _sum(dm, "kvferry_descriptors_total", path="staged") == parts
            assert _sum(pm, "kvferry_descriptors_total", pool="aux") == len(rooms)
            assert _sum(pm, "kvferry_bytes_total") == sent
            # Exposed transfer time: one per decode room prefill sent, within the rooms' own durations.
            assert _sum(dm, "kvferry_exposed_transfer_seconds_count") == len(rooms)
            assert 0 < _sum(dm, "kvferry_exposed_transfer_seconds_sum") <= _sum(dm, "kvferry_room_seconds_sum")
            assert _sum(pm, "kvferry_exposed_transfer_seconds_count") == 0

            # An abort from prefill mid-room: both sides count it, with its reason.
            p, d = _both(prefill, decode, [10, 11], p_opts={"abort": {10: 0.2}, "chunk_delay_s": 0.3})
            assert p["results"]["10"]["state"] == d["results"]["10"]["state"] == "Failed", (p, d)
            assert d["results"]["11"]["state"] == "Success"
            for side, port in ports.items():
                m = _scrape(port)
                assert _sum(m, "kvferry_rooms_total", role=side, state="Failed", reason="aborted") == 1, side
                assert _sum(m, "kvferry_rooms_total", role=side, state="Failed") == 1, side
                assert _sum(m, "kvferry_rooms_total", role=side, state="Success") == len(rooms) + 1, side
                assert _sum(m, "kvferry_bytes_total", role=side, pool="target") >= \
                    (pages + d["results"]["11"]["pages"]) * PAGE_BYTES
            for side, rank in (("prefill", prefill), ("decode", decode)):
                lines = [line for line in rank.log if "room failed:" in line]
                assert len(lines) == 1, (side, lines)  # one line per failed room, no duplicates
                assert f"side={side}" in lines[0] and "room=10 " in lines[0] and "reason=aborted" in lines[0]
        finally:
            prefill.close()
            decode.close()
