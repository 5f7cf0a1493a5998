"""A room whose prefill rank is still opening its way to the decode rank
says so: in its stats (``handshake_wait_s``), in a WARNING after 1 s on
both sides, in its failure message when the open fails, and in the ranks'
handshake counters (``ManagerStats``, hence ``/metrics``). The loopback
fabric holds every peer open (a stalled handshake)."""

from __future__ import annotations

import logging
import time

import numpy as np

from transfer.config import Role
from transfer.errors import HandshakeError
from transfer.rank.metrics import _Collector, _Source
from transfer.rooms.receiver import KVReceiver
from transfer.rooms.sender import KVSender
from transfer.round_times import RoundTimes
from transfer.state import KVPoll

from ._rooms import assert_landed, random_pages, run_room, terminal, wait_until


def test_a_room_waiting_on_a_held_handshake_says_so_then_lands(cluster, caplog):
    caplog.set_level(logging.WARNING, logger="kvferry")
    # decode waits 5 s for a hello's answer (rpc_timeout_s, the default) before it looks the node up again
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE, rpc_timeout_s=5.0)
    rng = np.random.default_rng(1)
    src, dst = random_pages(rng, 6), random_pages(rng, 6)
    cluster.fabric.hold_opens()
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 5)
    receiver.init(dst, 2)
    sender = KVSender(prefill.mgr, None, 5)
    time.sleep(1.4)
    assert receiver.poll() is KVPoll.Bootstrapping and sender.poll() is KVPoll.Bootstrapping
    waited = receiver.stats().handshake_wait_s
    assert 1.0 < waited < 3.0, waited
    assert "has not answered this rank's handshake for 1." in caplog.text
    assert "opening the way to" in caplog.text and "its handshake has taken 1." in caplog.text
    assert decode.mgr.stats().handshakes_in_progress == 1 and prefill.mgr.stats().handshakes_in_progress == 1
    cluster.fabric.release_opens()
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(len(src), 1)
    sender.send(src, last=True)
    wait_until(decode.mgr, lambda: terminal(sender, receiver))
    assert receiver.poll() is KVPoll.Success and sender.poll() is KVPoll.Success
    assert_landed(prefill, decode, src, dst)
    final = receiver.stats().handshake_wait_s
    assert waited <= final < waited + 1.0  # frozen once the link was ready
    for mgr in (prefill.mgr, decode.mgr):
        s = mgr.stats()
        assert s.handshakes == 1 and s.handshake_failures == 0 and s.handshakes_in_progress == 0
        assert s.handshake_seconds > 1.0, (mgr.where, s.handshake_seconds)
    # a second room on the open link waits on nothing
    _, second = run_room(prefill, decode, 6, src, random_pages(rng, 6))
    assert second.poll() is KVPoll.Success and second.stats().handshake_wait_s == 0.0


def test_an_open_past_its_bound_fails_the_room_naming_the_handshake_and_is_counted(cluster):
    prefill = cluster.rank(Role.PREFILL, handshake_timeout_s=0.5)
    decode = cluster.rank(Role.DECODE)
    rng = np.random.default_rng(2)
    dst = random_pages(rng, 4)
    cluster.fabric.hold_opens()
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 7)
    receiver.init(dst, 2)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="the room failed")
    try:
        receiver.failure_exception()
    except HandshakeError as exc:
        error = exc
    else:
        raise AssertionError("no HandshakeError")
    assert "handshake" in str(error) and prefill.mgr.rank.session in str(error)
    assert decode.mgr.rank.session in str(error) and "did not finish within 0.5 s" in str(error)
    assert prefill.mgr.stats().handshake_timeouts == 1 and decode.mgr.stats().handshake_failures == 1
    # the next room tries afresh, and lands once opens go through
    cluster.fabric.release_opens()
    src = random_pages(rng, 4)
    _, receiver2 = run_room(prefill, decode, 8, src, random_pages(rng, 4))
    assert receiver2.poll() is KVPoll.Success and prefill.mgr.stats().handshakes == 1


def test_metrics_export_the_handshake_counters(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(3)
    run_room(prefill, decode, 9, random_pages(rng, 3), random_pages(rng, 3))

    class Endpoint:
        @staticmethod
        def sources():
            return [_Source(prefill.mgr.stats, RoundTimes()), _Source(decode.mgr.stats, RoundTimes())]

    families = {f.name: f for f in _Collector(Endpoint()).collect()}
    opened = {(s.labels["role"], s.labels["result"]): s.value for s in families["kvferry_handshakes"].samples
              if s.name == "kvferry_handshakes_total"}
    assert opened[("prefill", "opened")] == 1 and opened[("decode", "opened")] == 1
    assert opened[("prefill", "failed")] == 0
    seconds = {s.labels["role"]: s.value for s in families["kvferry_handshake_seconds"].samples}
    assert seconds["prefill"] > 0 and seconds["decode"] > 0
