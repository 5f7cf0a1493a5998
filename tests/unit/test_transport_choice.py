"""Choosing the transport: EngineConfig.backend and its NIXL options, the
transport named in the handshake (a mismatch refused by name, an optional
field that Mooncake ranks leave off the wire), NIXL's peer metadata, and the
worker pieces every transport shares. Pure: no engine is started."""

from __future__ import annotations

import time
import threading
from dataclasses import replace
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest

import transfer.messages as tm
from bootstrap import codec
from bootstrap.errors import ProtocolError
from transfer.config import EngineConfig, Role, manager_config_from_env
from transfer.errors import ClosedError, IncompatibleLayoutError, IncompatibleTransportError, TransferError
from transfer.layout import check_compatible
from transfer.transport.nixl.peers import decode_metadata, encode_metadata
from transfer.transport.worker import PollingWorker, end_job, gate_state

from ._fixtures import mha_rank


# --- config ----------------------------------------------------------------------


def test_the_backend_is_mooncake_unless_asked():
    assert EngineConfig().backend == "mooncake"
    assert EngineConfig(backend="nixl").nixl_backend == "UCX"
    with pytest.raises(ValueError, match="backend must be one of mooncake, nixl"):
        EngineConfig(backend="ucx")


@pytest.mark.parametrize("given", [{"num_workers": 2, "ucx_error_handling_mode": "none"},
                                   [("ucx_error_handling_mode", "none"), ("num_workers", "2")],
                                   "num_workers=2, ucx_error_handling_mode=none"])
def test_nixl_options_are_kept_as_sorted_string_pairs(given):
    config = EngineConfig(backend="nixl", nixl_options=given)
    assert config.nixl_options == (("num_workers", "2"), ("ucx_error_handling_mode", "none"))
    hash(config)  # still a frozen, hashable config


def test_a_nixl_option_needs_a_name():
    with pytest.raises(ValueError, match="every option needs a name"):
        EngineConfig(nixl_options="=3")


def test_the_backend_and_options_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVFERRY_BACKEND", "nixl")
    monkeypatch.setenv("KVFERRY_NIXL_OPTIONS", "num_workers=4")
    engine = manager_config_from_env(Role.DECODE).engine
    assert (engine.backend, engine.nixl_options) == ("nixl", (("num_workers", "4"),))


# --- handshake -------------------------------------------------------------------


@pytest.mark.parametrize("local_is_prefill", [True, False])
def test_a_transport_mismatch_is_refused_naming_both_engines(local_is_prefill):
    prefill, decode = replace(mha_rank(), transport="nixl"), mha_rank(tp_rank=0)
    local, remote = (prefill, decode) if local_is_prefill else (decode, prefill)
    with pytest.raises(IncompatibleTransportError) as info:
        check_compatible(local, remote, local_is_prefill=local_is_prefill)
    assert isinstance(info.value, IncompatibleLayoutError) and info.value.field == "transport"
    if local_is_prefill:
        assert "decode rank prefill-0 dp 0 tp 0/1 uses transport mooncake, this prefill rank uses nixl" in str(info.value)
    else:
        assert "prefill rank prefill-0 dp 0 tp 0/1 uses transport nixl, this decode rank uses mooncake" in str(info.value)
    check_compatible(replace(decode, transport="nixl"), prefill, local_is_prefill=False)  # same engine: fine


def test_a_mooncake_rank_leaves_the_new_fields_off_the_wire():
    """Version 4 peers without the fields still decode a Mooncake rank's hello."""
    hello = tm.PeerHello(rank=mha_rank(), allow_missing_draft=False)
    body = msgpack.unpackb(codec.encode(hello))["body"]
    assert "transport_meta" not in body and "transport" not in body["rank"]
    assert codec.decode(codec.encode(hello)) == hello


def test_a_nixl_rank_sends_its_transport_and_metadata():
    hello = tm.PeerHello(rank=replace(mha_rank(), transport="nixl"), allow_missing_draft=False, transport_meta=b"\x01meta")
    body = msgpack.unpackb(codec.encode(hello))["body"]
    assert body["rank"]["transport"] == "nixl" and body["transport_meta"] == b"\x01meta"
    assert codec.decode(codec.encode(hello)) == hello


# --- NIXL peer metadata ----------------------------------------------------------


def test_peer_metadata_round_trips_and_checks_every_descriptor():
    blob = encode_metadata(b"agent-md", [(0x9000, 0x1000), (0x1000, 0x2000)])
    agent, regions = decode_metadata(blob)
    assert agent == b"agent-md"
    addrs = np.array([0x1000, 0x2ff0, 0x9000, 0x9ff0], dtype=np.uint64)
    assert regions.first_outside(addrs, np.full(4, 0x10, dtype=np.uint64)) == -1
    # straddling the end of a region, in the gap between two, past the last
    for addr, n in ((0x2ff0, 0x20), (0x5000, 8), (0xa000, 1), (0x0, 8)):
        both = np.array([0x1000, addr], dtype=np.uint64)
        assert regions.first_outside(both, np.array([8, n], dtype=np.uint64)) == 1, hex(addr)


def test_peer_metadata_with_no_regions_refuses_every_write():
    _, regions = decode_metadata(encode_metadata(b"md", []))
    assert regions.first_outside(np.array([0x1000], dtype=np.uint64), np.array([1], dtype=np.uint64)) == 0


@pytest.mark.parametrize("blob", [b"", b"KVFN", b"XXXX\x01\x00\x00\x00\x00md", b"KVFN\x02\x00\x00\x00\x00md",
                                  b"KVFN\x01\x05\x00\x00\x00" + bytes(16)])
def test_malformed_peer_metadata_is_a_protocol_error(blob):
    with pytest.raises(ProtocolError):
        decode_metadata(blob)


# --- the shared worker -----------------------------------------------------------


class _Gate:
    def __init__(self, done=False, error=None):
        self._done, self._error = done, error

    def done(self):
        if self._error is not None:
            raise self._error
        return self._done


def test_gate_state_waits_goes_or_fails():
    assert gate_state(None, "p") == (False, None)
    assert gate_state(_Gate(done=False), "p") == (True, None)
    assert gate_state(_Gate(done=True), "p") == (False, None)
    waiting, error = gate_state(_Gate(error=TransferError("late")), "peer-1")
    assert not waiting and isinstance(error, TransferError) and error.peer == "peer-1"


def test_a_raising_callback_is_logged_and_the_worker_goes_on(caplog):
    calls = []

    def callback(error):
        calls.append(error)
        raise RuntimeError("boom")
    job = SimpleNamespace(done=False, callback=callback)
    end_job(job, None)
    assert calls == [None] and "a completion callback raised" in caplog.text


def test_an_ended_job_lets_go_of_its_callback_and_never_calls_it_twice():
    calls = []
    job = SimpleNamespace(done=False, callback=calls.append)
    end_job(job, None)
    end_job(job, TransferError("late"))
    assert calls == [None] and job.done and job.callback is None


class _Job(str):
    """A job of the fake side: its name, to one peer."""

    peer = "peer-0"


class _BusySide:
    """An engine side whose first step blocks until released (its peer opens at once)."""

    def __init__(self) -> None:
        self.stepping, self.release = threading.Event(), threading.Event()
        self.held, self.failed = [], []

    def open(self, peer, blob, pause) -> None:
        """Nothing to open."""

    def describe_open(self, link) -> str:
        return ""

    def admit(self, job) -> None:
        self.held.append(job)

    def step(self, may_submit):
        self.stepping.set()
        self.release.wait(5)
        return 0, bool(self.held)

    def fail(self, job, error=None) -> None:
        self.failed.append(job)

    def fail_all(self) -> None:
        self.failed.extend(self.held)
        self.held = []

    def idle(self) -> None:
        """Nothing to tidy."""


def test_close_fails_the_jobs_left_in_the_queue_and_refuses_new_ones():
    side = _BusySide()
    worker = PollingWorker(side)
    worker.put(_Job("x"))  # its peer opens (the opener's thread), then the loop steps and blocks
    side.stepping.wait(5)  # the loop is busy: it takes none of the jobs queued behind
    worker.put(_Job("a"))
    worker.put(_Job("b"))
    assert worker.close(0.2) is True  # the step runs past the bound
    assert side.failed == ["a", "b"]
    with pytest.raises(ClosedError):
        worker.put(_Job("c"))
    side.release.set()
    worker._thread.join(5)
    assert not worker._thread.is_alive() and side.failed == ["a", "b", "x"]  # each job failed once
    assert worker.close(5.0) is False  # idempotent


def test_the_loop_admits_steps_and_fails_what_it_holds_at_close():
    side = _BusySide()
    side.release.set()
    worker = PollingWorker(side)
    worker.put(_Job("a"))
    deadline = time.monotonic() + 5
    while side.held != ["a"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert side.held == ["a"] and worker.num_rounds >= 1
    assert worker.close(5.0) is True
    assert side.failed == ["a"]


def test_health_tells_a_worker_stuck_in_an_engine_round_from_an_idle_one():
    side = _BusySide()
    worker = PollingWorker(side)
    try:
        worker.put(_Job("a"))
        assert side.stepping.wait(5)
        time.sleep(1.2)
        assert "in one engine round for 1." in worker.health()
        side.release.set()
        deadline = time.monotonic() + 5
        while "last round ended" not in worker.health() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "last round ended" in worker.health()
    finally:
        side.release.set()
        worker.close(5.0)
