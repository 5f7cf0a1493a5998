"""The storage tier end to end, with real processes, real Mooncake transfers
and a real store: prefill writes pages through; decode restores a room from
storage when its prefill dies mid-request, and skips what storage already
has (selective send of the rest)."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from tests.storage._mooncake import MooncakeCluster
from harness.launch import BootstrapProcess
from transfer.storage.nixl.probe import nixl_missing_reason

from .conftest import only_on
from .ranks import FAST, Rank, assert_all_success, fault_spec

pytestmark = pytest.mark.e2e

# 4 layers x K/V x 8 heads x 128 x bf16 per token: one 16-token page is 256 KiB.
PAGE_BYTES = 4 * 2 * 16 * 8 * 128 * 2


@pytest.fixture
def store_url(tmp_path):
    return f"file://{tmp_path / 'kv'}"


NIXL_MISSING = nixl_missing_reason()


@pytest.fixture(params=["file", pytest.param("nixl", marks=pytest.mark.skipif(
    bool(NIXL_MISSING), reason=f"nixl backend: {NIXL_MISSING}")), "mooncake"])
def any_store_url(request, tmp_path):
    """A store both ranks share, of each backend: files, NIXL (POSIX) files,
    Mooncake Store (a real master and a holder process on loopback)."""
    if request.param == "file":
        yield f"file://{tmp_path / 'kv'}"
    elif request.param == "nixl":
        yield f"nixl://{tmp_path / 'kv'}?backend=POSIX&xfer_timeout_s=20"
    else:
        cluster = MooncakeCluster(tmp_path, holder_bytes=256 << 20)
        try:
            yield cluster.url + "&call_timeout_s=20"
        finally:
            cluster.stop()


def _ranks(server, store_url, decode_cfg=None, **spec_kw):
    spec = fault_spec(server.address, **spec_kw)
    cfg = {**FAST, "storage_url": store_url, "model_name": "test-model"}
    return Rank("prefill", spec, cfg), Rank("decode", spec, {**cfg, **(decode_cfg or {})})


@only_on("mooncake", "its premise is a write to a stopped decode that stalls; NIXL's UCX on one host writes "
                    "into the stopped process's memory itself (cross-memory attach), so the room lands from prefill")
def test_prefill_killed_mid_request_decode_restores_from_storage(any_store_url):
    """Prefill writes through and is killed (SIGKILL) while its transfers are
    stalled (decode stopped); decode, resumed, finds the prefill dead, and
    completes both rooms from storage, byte-exact, within the bound."""
    with BootstrapProcess() as server:
        prefill, decode = _ranks(server, any_store_url, min_tokens=1024, max_tokens=1024, chunk_pages=16)
        try:
            p, d = _send_both(prefill, decode, [1], tokens=True)
            assert_all_success(p, [1])
            assert_all_success(d, [1])
            rooms = [10, 11]
            decode.send(op="rooms", rooms=rooms, timeout_s=60, tokens=True)
            time.sleep(1.0)  # the requests reach prefill
            decode.kill(signal.SIGSTOP)  # prefill's writes to decode stall from here on
            prefill.send(op="rooms", rooms=rooms, timeout_s=60, tokens=True)
            time.sleep(1.2)  # prefill sends what it can and writes the pages through
            written = prefill.stats()["pages_written"]
            assert written >= 64 + 2 * 64, f"write-through wrote {written} pages"
            killed_at = prefill.kill()
            decode.kill(signal.SIGCONT)
            res = decode.reply()
            assert_all_success(res, rooms)
            for room in rooms:
                r = res["results"][str(room)]
                assert r["from_storage"] == r["pages"] == 64, r
                assert r["ended_at"] - killed_at < FAST["peer_timeout_s"] + 8, r
        finally:
            prefill.close()
            decode.close()


def test_pages_in_storage_are_not_sent(store_url):
    """Half of room 21's prompt (its first 32 pages) is a prefix of room 20's,
    which prefill wrote through: decode prefetches those 32 pages, prefill
    sends only the other 32 (counted in bytes), and every byte is right."""
    with BootstrapProcess() as server:
        prefill, decode = _ranks(server, store_url, min_tokens=1024, max_tokens=1024)
        try:
            rng = np.random.default_rng(5)
            a = rng.permutation(256)[:64].tolist()
            rest = [p for p in range(256) if p not in a]
            b = a[:32] + rng.permutation(rest)[:32].tolist()
            plans = {"20": a, "21": b}
            p, d = _send_both(prefill, decode, [20], tokens=True, plans=plans)
            assert_all_success(p, [20])
            assert_all_success(d, [20])
            assert d["results"]["20"]["from_storage"] == 0
            before = prefill.stats()["bytes_sent"]
            time.sleep(0.3)  # room 20's write-through finished with its Success; be generous
            p, d = _send_both(prefill, decode, [21], tokens=True, plans=plans)
            assert_all_success(p, [21])
            assert_all_success(d, [21])
            assert d["results"]["21"]["from_storage"] == 32
            moved = p["bytes_sent"] - before
            # The aux row always comes from prefill: through the engine, or in the
            # room's final control message when decode is fenced (the default).
            aux = 0 if decode.ready["fenced"] else 64
            assert moved == 32 * PAGE_BYTES + aux, f"prefill moved {moved} bytes, expected {32 * PAGE_BYTES + aux}"
        finally:
            prefill.close()
            decode.close()


def test_restore_fails_naming_the_missing_range(store_url):
    """Nothing in storage and the prefill dead: the room fails, naming the
    pages storage lacks."""
    with BootstrapProcess() as server:
        prefill, decode = _ranks(server, store_url, min_tokens=1000, max_tokens=1000)
        try:
            p, d = _send_both(prefill, decode, [1])  # no tokens: nothing written through
            assert_all_success(d, [1])
            decode.send(op="rooms", rooms=[2], timeout_s=60, tokens=True, tail_tokens=8)
            time.sleep(0.5)
            killed_at = prefill.kill()
            r = decode.reply()["results"]["2"]
            assert r["state"] == "Failed" and r["error_type"] == "StorageMissError", r
            assert "target pages [0, 62) not in storage" in r["error"]
            assert "page 62 (the last, partly filled) is never stored" in r["error"]
            assert r["ended_at"] - killed_at < FAST["peer_timeout_s"] + 8
        finally:
            prefill.close()
            decode.close()


def test_prefill_abort_is_not_restored_from_storage(store_url):
    """A room the prefill scheduler cancels stays cancelled on decode, even
    with every page in storage; a room whose prefill fails otherwise is
    restored (the kill tests above)."""
    with BootstrapProcess() as server:
        prefill, decode = _ranks(server, store_url, {"storage_prefetch": "off"}, min_tokens=512, max_tokens=512,
                                 chunk_pages=4)
        try:
            plans = {"40": list(range(32)), "41": list(range(32))}  # the same prompt twice
            p, d = _send_both(prefill, decode, [40], tokens=True, plans=plans)
            assert_all_success(d, [40])
            decode.send(op="rooms", rooms=[41], timeout_s=60, tokens=True, plans=plans)
            prefill.send(op="rooms", rooms=[41], timeout_s=60, tokens=True, plans=plans, chunk_delay_s=0.3,
                         abort={"41": 0.5})
            p, r = prefill.reply(), decode.reply()["results"]["41"]
            assert p["results"]["41"]["state"] == "Failed"
            assert r["state"] == "Failed" and r["error_type"] == "PeerError", r
            assert "aborted by the test's prefill scheduler" in r["error"] and r["from_storage"] == 0
        finally:
            prefill.close()
            decode.close()


def _send_both(prefill, decode, rooms, **opts):
    decode.send(op="rooms", rooms=rooms, timeout_s=60, **opts)
    prefill.send(op="rooms", rooms=rooms, timeout_s=60, **opts)
    return prefill.reply(), decode.reply()
