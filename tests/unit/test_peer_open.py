"""Peer opens: the pure table (transfer.transport.peers) and the opener's
threads (transfer.transport.opener) around a fake engine call, and the
worker that holds a peer's jobs until it is open and submits nothing while
an engine call holds the engine's lock."""

from __future__ import annotations

import threading
import time

import pytest

from transfer.errors import HandshakeError, StateError, TransferError
from transfer.transport.opener import PeerOpener
from transfer.transport.peers import PeerState, PeerTable
from transfer.transport.worker import PollingWorker


# --- the table ----------------------------------------------------------------------------


def test_an_open_runs_once_and_its_waiters_join_it():
    table = PeerTable(timeout_s=2.0)
    first = table.ask("p", b"m1", now=10.0, waiter="w1")
    assert first is not None and (first.peer, first.blob) == ("p", b"m1") and table.state("p") is PeerState.OPENING
    assert table.ask("p", b"m1", now=10.1, waiter="w2") is None  # joins the running attempt
    link = table.finish("p", first.attempt, None, now=10.5)
    assert link.state is PeerState.OPEN and table.take_waiters(link) == ["w1", "w2"]
    assert table.num_opened == 1 and table.open_seconds == pytest.approx(0.5)
    assert table.ask("p", b"m1", now=11.0, waiter="w3") is None and table.state("p") is PeerState.OPEN
    assert table.ask("p", b"", now=11.0) is None  # no blob: nothing new to open


def test_an_open_peer_with_new_metadata_opens_again():
    table = PeerTable(timeout_s=2.0)
    a = table.ask("p", b"m1", now=0.0)
    table.finish("p", a.attempt, None, now=0.1)
    b = table.ask("p", b"m2", now=1.0)
    assert b is not None and b.blob == b"m2" and b.attempt != a.attempt and table.state("p") is PeerState.OPENING


def test_an_attempt_past_its_deadline_fails_and_its_late_result_is_dropped():
    table = PeerTable(timeout_s=2.0)
    a = table.ask("p", b"m", now=0.0, waiter="w")
    assert table.expire(now=1.9) == []
    late = table.expire(now=2.1, describe=lambda link: "the engine is busy")
    assert [link.peer for link in late] == ["p"] and table.state("p") is PeerState.FAILED
    error = late[0].error
    assert isinstance(error, HandshakeError) and error.peer == "p"
    assert str(error) == "the handshake with p did not finish within 2 s: the engine is busy"
    assert table.take_waiters(late[0]) == ["w"]
    assert table.finish("p", a.attempt, None, now=3.0) is None  # stale: the engine call ended late
    assert table.state("p") is PeerState.FAILED and table.num_timed_out == 1 and table.num_failed == 1


def test_a_failed_peer_is_tried_afresh():
    table = PeerTable(timeout_s=1.0)
    a = table.ask("p", b"m", now=0.0)
    table.finish("p", a.attempt, HandshakeError("refused", peer="p"), now=0.1)
    b = table.ask("p", b"", now=5.0)
    assert b is not None and b.blob == b"m" and table.state("p") is PeerState.OPENING  # its last metadata
    assert table.links["p"].error is None and table.links["p"].deadline == pytest.approx(6.0)


def test_illegal_moves_raise_and_the_timeout_must_be_positive():
    table = PeerTable(timeout_s=1.0)
    a = table.ask("p", b"m", now=0.0)
    table.finish("p", a.attempt, None, now=0.0)
    with pytest.raises(StateError, match="open -> open"):
        table.links["p"].move(PeerState.OPEN)
    with pytest.raises(ValueError):
        PeerTable(timeout_s=0)


def test_a_slow_open_is_reported_once_per_attempt():
    table = PeerTable(timeout_s=5.0)
    table.ask("p", b"m", now=0.0)
    assert table.slow(now=0.5, after_s=1.0) == []
    assert [link.peer for link in table.slow(now=1.2, after_s=1.0)] == ["p"]
    assert table.slow(now=2.0, after_s=1.0) == []


# --- the opener's threads, around a fake engine call ---------------------------------------


class FakeCall:
    """An engine open that blocks until released (``gate``), inside pause() when ``locks``."""

    def __init__(self, locks: bool = True) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.locks = locks
        self.calls: list[tuple[str, bytes, str]] = []
        self.error: TransferError | None = None

    def __call__(self, peer, blob, pause) -> None:
        self.calls.append((peer, blob, threading.current_thread().name))
        if self.locks:
            with pause():
                self.started.set()
                self.gate.wait(10)
        else:
            self.started.set()
            self.gate.wait(10)
        if self.error is not None:
            raise self.error


class Job:
    def __init__(self, peer: str) -> None:
        self.peer = peer


def _opener(call, timeout_s=5.0):
    released, failed = [], []
    opener = PeerOpener(call, timeout_s=timeout_s, step_lock=threading.Lock(), release=released.extend,
                        fail=lambda job, error: failed.append((job, error)))
    return opener, released, failed


def _wait(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_jobs_wait_for_their_peer_and_are_released_once_it_opened():
    call = FakeCall()
    opener, released, failed = _opener(call)
    try:
        told = []
        opener.open("p", b"meta", told.append)
        assert call.started.wait(5) and call.calls == [("p", b"meta", "kvferry-open-call")]
        assert opener.paused == 1  # the engine call holds the engine's lock
        job = Job("p")
        assert opener.admits(job) is False and not released
        call.gate.set()
        _wait(lambda: released == [job])
        assert told == [None] and opener.paused == 0 and opener.state("p") is PeerState.OPEN
        assert opener.admits(Job("p")) is True  # open now: straight to the engine
        again = []
        opener.open("p", b"meta", again.append)
        assert again == [None] and len(call.calls) == 1  # open already: called back at once, no engine call
        assert opener.counters()["handshakes"] == 1 and not failed
    finally:
        call.gate.set()
        opener.close()


def test_a_stuck_engine_call_fails_its_peer_at_the_deadline_and_the_next_peer_says_what_it_waits_behind():
    call = FakeCall()
    opener, released, failed = _opener(call, timeout_s=0.3)
    try:
        first, second = [], []
        t0 = time.monotonic()
        opener.open("stuck", b"m", first.append)
        assert call.started.wait(5)
        job = Job("stuck")
        opener.admits(job)
        opener.open("next", b"m", second.append)  # queued behind the stuck call: one engine call at a time
        _wait(lambda: first and second)
        assert time.monotonic() - t0 < 2.0
        assert isinstance(first[0], HandshakeError) and "did not finish within 0.3 s" in str(first[0])
        assert isinstance(second[0], HandshakeError) and "waiting behind the handshake with stuck" in str(second[0])
        assert failed == [(job, first[0])] and not released
        counts = opener.counters()
        assert counts["handshake_timeouts"] == 2 and counts["handshakes"] == 0
        call.gate.set()  # the late result of "stuck" is dropped; "next" never ran its call
        time.sleep(0.1)
        assert opener.state("stuck") is PeerState.FAILED and [c[0] for c in call.calls] == ["stuck"]
    finally:
        call.gate.set()
        opener.close()


def test_an_engine_error_becomes_a_handshake_error_naming_the_peer():
    call = FakeCall(locks=False)
    call.error = TransferError("refused at the door", peer="p", code=-1)
    call.gate.set()
    opener, _, failed = _opener(call)
    try:
        told = []
        job = Job("p")
        opener.admits(job)  # a job for a peer never opened asks for its open (no metadata)
        opener.open("p", b"", told.append)
        _wait(lambda: told)
        assert isinstance(told[0], HandshakeError) and told[0].peer == "p" and told[0].code == -1
        assert "the handshake with p failed: refused at the door" in str(told[0])
        assert failed == [(job, told[0])] and call.calls[0][:2] == ("p", b"")
    finally:
        opener.close()


def test_close_fails_parked_jobs_and_waiters():
    call = FakeCall()
    opener, _, failed = _opener(call)
    told = []
    opener.open("p", b"m", told.append)
    assert call.started.wait(5)
    opener.admits(Job("p"))
    opener.close()
    call.gate.set()
    assert len(failed) == 1 and isinstance(failed[0][1], TransferError) and isinstance(told[0], TransferError)


# --- the worker: nothing submitted while an engine call holds the engine's lock ------------


class Side:
    """An engine side that records each step's may_submit and its peer opens."""

    def __init__(self, call: FakeCall) -> None:
        self.call = call
        self.steps: list[bool] = []
        self.admitted: list = []
        self.failed: list = []

    def open(self, peer, blob, pause) -> None:
        self.call(peer, blob, pause)

    def describe_open(self, link) -> str:
        return "fake"

    def admit(self, job) -> None:
        self.admitted.append(job)

    def step(self, may_submit: bool):
        self.steps.append(may_submit)
        return 0, False

    def fail(self, job, error=None) -> None:
        self.failed.append((job, error))

    def fail_all(self) -> None:
        pass

    def idle(self) -> None:
        pass


def test_the_worker_submits_nothing_while_a_peer_open_holds_the_engine_and_pump_never_waits():
    call = FakeCall()
    side = Side(call)
    worker = PollingWorker(side, open_timeout_s=5.0)
    try:
        worker.put(Job("a"))  # peer a opens (held inside pause())
        assert call.started.wait(5)
        worker.wake()
        _wait(lambda: side.steps)
        assert side.admitted == [] and all(s is False for s in side.steps)  # a's job waits for its peer
        # the open holds until the gate is set: a pump that waited for it would not return before that
        pumping = threading.Thread(target=worker.pump)
        pumping.start()
        pumping.join(5.0)
        assert not pumping.is_alive(), "pump() waited for the peer open that holds the engine"
        call.gate.set()
        _wait(lambda: side.admitted)
        worker.wake()
        n = len(side.steps)
        _wait(lambda: len(side.steps) > n)
        assert side.steps[-1] is True and [j.peer for j in side.admitted] == ["a"]
    finally:
        call.gate.set()
        worker.close(5.0)
