"""The Mooncake transport hands its engine at most
``inflight_bytes_per_peer`` bytes per peer; what waits beyond it goes lowest
priority (the oldest room) first. Real engines on TCP loopback, random bytes
compared exactly."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

from transfer.config import EngineConfig  # noqa: E402
from transfer.plan import TransferPlan  # noqa: E402
from transfer.transport.mooncake.transport import MooncakeTransport  # noqa: E402

PIECE = 64 << 10


def test_the_inflight_bytes_default_by_protocol_and_its_check():
    assert EngineConfig(protocol="tcp").inflight_bytes_per_peer == 256 << 20
    assert EngineConfig(protocol="rdma").inflight_bytes_per_peer == 1 << 30
    assert EngineConfig(protocol="tcp", max_inflight_bytes_per_peer=1 << 20).inflight_bytes_per_peer == 1 << 20
    with pytest.raises(ValueError, match="max_inflight_bytes_per_peer"):
        EngineConfig(max_inflight_bytes_per_peer=-1)


def test_jobs_beyond_the_window_go_lowest_priority_first_and_land_byte_exact():
    cfg = EngineConfig(protocol="tcp", hostname="127.0.0.1", max_inflight_bytes_per_peer=PIECE,
                       max_descriptor_bytes=PIECE)
    a, b = MooncakeTransport(cfg), MooncakeTransport(cfg)
    jobs = {"old": (3, 1.0), "new": (2, 9.0), "middle": (4, 5.0)}  # name: (pieces, priority)
    total = sum(n for n, _ in jobs.values()) * PIECE
    src = np.random.default_rng(30).integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    a.register([(src.ctypes.data, src.nbytes)])
    b.register([(dst.ctypes.data, dst.nbytes)])
    order: list[str] = []
    try:
        # The way to the peer is opened first (as kvferry's handshake does); then the worker is held
        # while three jobs queue (in an order that is not their priority's), so that its next round sees all three.
        _open(a, b)
        offset = 0
        with a._worker._step_lock:
            for name in ("new", "old", "middle"):
                pieces, priority = jobs[name]
                a.submit(b.session, _plan(src, dst, offset, pieces * PIECE),
                         lambda err, name=name: order.append((name, err)), None, priority=priority)
                offset += pieces * PIECE
        _wait(lambda: len(order) == 3, "the three jobs")
        # One piece in the engine at a time: each job ends before the next one starts.
        assert order == [("old", None), ("middle", None), ("new", None)]
        assert np.array_equal(dst, src)
    finally:
        a.close()
        b.close()


def test_an_older_room_overtakes_newer_ones_already_queued():
    """A newer room's 16 writes of 4 MiB were queued first; an older room's
    write, queued when the first of them ended, goes next, because one write
    at a time is handed to the engine (without the window all 16 would be in
    the engine already, and the older room's write would end last)."""
    piece = 4 << 20
    cfg = EngineConfig(protocol="tcp", hostname="127.0.0.1", max_inflight_bytes_per_peer=piece)
    a, b = MooncakeTransport(cfg), MooncakeTransport(cfg)
    newer_n = 16
    src = np.random.default_rng(31).integers(0, 256, (newer_n + 1) * piece, dtype=np.uint8)
    dst = np.zeros_like(src)
    a.register([(src.ctypes.data, src.nbytes)])
    b.register([(dst.ctypes.data, dst.nbytes)])
    order: list = []

    def newer_done(err):
        order.append(("newer", err))
        if len(order) == 1:  # on the worker's thread: queued before its next round
            a.submit(b.session, _plan(src, dst, newer_n * piece, piece), lambda e: order.append(("older", e)),
                     None, priority=1.0)

    try:
        _open(a, b)
        jobs = [a.submit(b.session, _plan(src, dst, i * piece, piece), newer_done, None, priority=9.0)
                for i in range(newer_n)]
        # a job held back says what holds the link
        assert f"in the engine (at most {piece})" in a.describe_job(jobs[-1])
        _wait(lambda: len(order) == newer_n + 1, "every write")
        assert all(err is None for _, err in order), order
        # behind it at most the newer write(s) the engine held when it came
        assert order.index(("older", None)) <= 3, order
        assert np.array_equal(dst, src)
    finally:
        a.close()
        b.close()


def _open(a: MooncakeTransport, b: MooncakeTransport) -> None:
    """``a`` opens its way to ``b`` from ``b``'s handshake metadata, as a prefill rank does."""
    opened: list = []
    a.open_peer(b.session, b.metadata(), opened.append)
    _wait(lambda: opened, "the open")
    assert opened == [None]


def _plan(src, dst, offset: int, n: int) -> TransferPlan:
    return TransferPlan(np.array([src.ctypes.data + offset], dtype=np.uint64),
                        np.array([dst.ctypes.data + offset], dtype=np.uint64), np.array([n], dtype=np.uint64))


def _wait(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not end within {timeout_s} s"
        time.sleep(0.01)
