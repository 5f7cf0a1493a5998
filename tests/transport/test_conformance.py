"""The Transport contract (transfer/transport/base.py), one suite that every
transport passes: the in-process loopback, the real Mooncake engine (TCP on
loopback) and NIXL (UCX on loopback; skipped, with the reason, where NIXL
does not import). Two transports in this process, random bytes compared
exactly."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from transfer.config import EngineConfig
from transfer.errors import ClosedError, HandshakeError, KVTimeoutError, ProtocolError, TransferError
from transfer.plan import TransferPlan
from transfer.ready import ReadyGate
from transfer.storage.nixl.probe import nixl_missing_reason
from transfer.transport.base import Transport
from transfer.transport.factory import build_transport
from transfer.transport.loopback import LoopbackFabric

from tests.unit._fakecuda import FakeEvent

NIXL_MISSING = nixl_missing_reason()
KINDS = ["loopback", "mooncake",
         pytest.param("nixl", marks=pytest.mark.skipif(bool(NIXL_MISSING), reason=f"nixl: {NIXL_MISSING}"))]
PAGE = 4096
NUM_PAGES = 64


def _build(kind: str, fabric: LoopbackFabric) -> Transport:
    if kind == "loopback":
        return fabric.transport()
    return build_transport(EngineConfig(protocol="tcp", backend=kind, progress_timeout_s=5))


class Pair:
    """A writer ``a`` (its registered ``src``) and a target ``b`` (``dst``)."""

    def __init__(self, kind: str, monkeypatch) -> None:
        monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # UCX listens on loopback only
        self.fabric = LoopbackFabric()
        self.a, self.b = _build(kind, self.fabric), _build(kind, self.fabric)
        self.src = np.random.default_rng(26).integers(0, 256, NUM_PAGES * PAGE, dtype=np.uint8)
        self.dst = np.zeros(NUM_PAGES * PAGE, dtype=np.uint8)
        self.a.register([(self.src.ctypes.data, self.src.nbytes)])
        self.b.register([(self.dst.ctypes.data, self.dst.nbytes)])
        self.announce()

    def announce(self) -> None:
        """The target's metadata to the writer, as kvferry's handshake
        carries it; returns once the writer opened its way to the target."""
        opened = Done()
        self.a.open_peer(self.b.session, self.blob(), opened)
        assert opened.wait() is None

    def blob(self) -> bytes:
        return self.b.peer_metadata.metadata() if self.b.peer_metadata is not None else b""

    def plan(self, src_pages, dst_pages, *, dst_base: int | None = None) -> TransferPlan:
        base = self.dst.ctypes.data if dst_base is None else dst_base
        s = (self.src.ctypes.data + np.asarray(src_pages, dtype=np.int64) * PAGE).astype(np.uint64)
        d = (base + np.asarray(dst_pages, dtype=np.int64) * PAGE).astype(np.uint64)
        return TransferPlan(s, d, np.full(len(s), PAGE, dtype=np.uint64))

    def page(self, array, i) -> bytes:
        return array[i * PAGE:(i + 1) * PAGE].tobytes()

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(params=KINDS)
def pair(request, monkeypatch):
    p = Pair(request.param, monkeypatch)
    yield p
    p.close()


class Done:
    """A completion callback that records each call and its thread."""

    def __init__(self) -> None:
        self.calls, self.threads = [], []
        self.event = threading.Event()

    def __call__(self, error) -> None:
        self.calls.append(error)
        self.threads.append(threading.current_thread().name)
        self.event.set()

    def wait(self, timeout_s: float = 20.0):
        assert self.event.wait(timeout_s), f"no callback within {timeout_s} s"
        return self.calls[0]


def test_it_names_itself(pair):
    for t in (pair.a, pair.b):
        assert isinstance(t.kind, str) and t.kind and isinstance(t.session, str) and t.session
        assert isinstance(t.describe(), str) and t.describe()
        assert t.peer_metadata is None or callable(t.peer_metadata.metadata)
    assert pair.a.session != pair.b.session and pair.a.kind == pair.b.kind


def test_open_peer_calls_back_once_open_and_again_at_once(pair):
    # Pair() opened a -> b already: the way is open, the callback runs at once on this thread
    again = Done()
    pair.a.open_peer(pair.b.session, pair.blob(), again)
    assert again.calls == [None] and again.threads == [threading.current_thread().name]
    counts = pair.a.handshake_counts()
    assert counts["handshakes"] == 1 and counts["handshake_failures"] == 0 and counts["handshakes_in_progress"] == 0
    assert counts["handshake_seconds"] > 0


def test_the_first_open_runs_on_the_opener_and_never_on_the_callers_thread(pair):
    third = _build(pair.a.kind, pair.fabric)
    third.register([(pair.src.ctypes.data, pair.src.nbytes)])  # NIXL and the loopback read registered memory only
    try:
        opened = Done()
        t0 = time.perf_counter()
        third.open_peer(pair.b.session, pair.blob(), opened)
        returned_s = time.perf_counter() - t0
        assert opened.wait() is None and opened.threads == ["kvferry-opener"]
        assert returned_s < 0.05, f"open_peer took {returned_s * 1e3:.1f} ms on the caller's thread"
        done = Done()
        third.submit(pair.b.session, pair.plan([9], [10]), done, None)
        assert done.wait() is None and pair.page(pair.dst, 10) == pair.page(pair.src, 9)
    finally:
        third.close()


def test_a_malformed_handshake_blob_is_refused_at_once(pair):
    if pair.a.peer_metadata is None:
        pytest.skip("this transport's peers carry no metadata")
    with pytest.raises(ProtocolError):
        pair.a.open_peer("127.0.0.1:7", b"not metadata", Done())


def test_a_plan_lands_byte_exact_and_calls_back_once_on_the_worker(pair):
    rng = np.random.default_rng(3)
    src_pages, dst_pages = rng.permutation(NUM_PAGES)[:20], rng.permutation(NUM_PAGES)[:20]
    done = Done()
    assert pair.a.submit(pair.b.session, pair.plan(src_pages, dst_pages), done, None) is not None
    assert done.wait() is None
    time.sleep(0.05)  # a second call would come now
    assert done.calls == [None] and done.threads == ["kvferry-transport"]
    for s, d in zip(src_pages, dst_pages):
        assert pair.page(pair.dst, d) == pair.page(pair.src, s)
    untouched = sorted(set(range(NUM_PAGES)) - set(dst_pages.tolist()))
    assert all(set(pair.page(pair.dst, d)) == {0} for d in untouched)
    assert pair.a.num_bytes == 20 * PAGE and pair.a.num_descriptors >= 1


def test_an_empty_plan_completes_before_submit_returns(pair):
    done = Done()
    assert pair.a.submit(pair.b.session, TransferPlan.empty(), done, None) is None
    assert done.calls == [None]


def test_a_destination_outside_the_peers_registered_memory_fails(pair):
    outside = np.zeros(4 * PAGE, dtype=np.uint8)  # never registered by anyone
    done = Done()
    pair.a.submit(pair.b.session, pair.plan([0, 1], [0, 1], dst_base=outside.ctypes.data), done, None)
    assert isinstance(done.wait(), TransferError)
    assert set(outside.tobytes()) == {0} and pair.a.num_bytes == 0


def test_nothing_is_read_before_the_ready_gate_is_done(pair):
    event = FakeEvent()
    gated, other = Done(), Done()
    pair.a.submit(pair.b.session, pair.plan([1], [1]), gated, ReadyGate(event, 30.0, "room 1"))
    pair.a.submit(pair.b.session, pair.plan([2], [2]), other, None)  # a later plan goes ahead
    assert other.wait() is None
    time.sleep(0.1)
    assert not gated.calls and set(pair.page(pair.dst, 1)) == {0}
    event.complete()
    assert gated.wait() is None and pair.page(pair.dst, 1) == pair.page(pair.src, 1)


def test_describe_job_says_whether_a_plan_waits_or_ended(pair):
    event = FakeEvent()
    gated = Done()
    handle = pair.a.submit(pair.b.session, pair.plan([4], [4]), gated, ReadyGate(event, 30.0, "room 4"))
    time.sleep(0.1)
    waiting = pair.a.describe_job(handle)
    assert pair.b.session in waiting and f"{pair.b.session} ended" not in waiting and "last round ended" in waiting
    event.complete()
    assert gated.wait() is None
    assert f"write to {pair.b.session} ended" in pair.a.describe_job(handle)


def test_a_gate_past_its_deadline_fails_the_plan(pair):
    done = Done()
    gate = ReadyGate(FakeEvent(), 0.0, "room 2")
    time.sleep(0.01)
    pair.a.submit(pair.b.session, pair.plan([3], [3]), done, gate)
    error = done.wait()
    assert isinstance(error, TransferError) and "did not complete within 0 s" in str(error)
    assert set(pair.page(pair.dst, 3)) == {0}
    with pytest.raises(KVTimeoutError):
        gate.wait()


def test_a_cancelled_plan_fails_without_writing(pair):
    done = Done()
    event = FakeEvent()
    handle = pair.a.submit(pair.b.session, pair.plan([4, 5], [4, 5]), done, ReadyGate(event, 30.0, "room 3"))
    handle.cancel()
    assert isinstance(done.wait(), TransferError)
    event.complete()
    time.sleep(0.05)
    assert done.calls[1:] == [] and set(pair.page(pair.dst, 4) + pair.page(pair.dst, 5)) == {0}


def test_a_write_to_an_unknown_peer_fails(pair):
    done = Done()
    pair.a.submit("127.0.0.1:1", pair.plan([6], [6]), done, None)
    error = done.wait()
    assert isinstance(error, TransferError) and "127.0.0.1:1" in str(error)
    if pair.a.kind != "loopback":  # the fabric reaches every session: its copy fails, not the open
        assert isinstance(error, HandshakeError) and "handshake" in str(error)


def test_unregistered_memory_takes_no_new_write(pair):
    pair.b.unregister([(pair.dst.ctypes.data, pair.dst.nbytes)])
    pair.announce()
    done = Done()
    pair.a.submit(pair.b.session, pair.plan([7], [7]), done, None)
    assert isinstance(done.wait(), TransferError)
    assert set(pair.page(pair.dst, 7)) == {0}


def test_close_fails_what_is_outstanding_once_and_refuses_more(pair):
    held = Done()
    pair.a.submit(pair.b.session, pair.plan([8], [8]), held, ReadyGate(FakeEvent(), 30.0, "room 4"))
    pair.a.close()
    assert isinstance(held.wait(5.0), TransferError)
    time.sleep(0.05)
    assert len(held.calls) == 1
    with pytest.raises(ClosedError):
        pair.a.submit(pair.b.session, pair.plan([9], [9]), Done(), None)
    pair.a.close()  # idempotent
