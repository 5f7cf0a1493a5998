"""Issue 25: requests that never reach a prefill rank. A decode rank resolves
a prefill group from the ranks its routes name (the others may have left),
a needed rank that left fails the room at once, and a request lost on the
way or dropped by prefill fails its room within a heartbeat or two, with
prefill told. Loopback pair (:mod:`tests.unit._rooms`), bytes compared."""

from __future__ import annotations

import time

import numpy as np
import pytest

from transfer import KVPoll, KVReceiver, KVSender, Role
from transfer.errors import PeerError
from transfer.messages import TransferRequest
from transfer.rooms import prefill_table
from transfer.stats import FailureReason, failure_reason

from ._rooms import FAST, assert_landed, random_pages, run_room, terminal, wait_until

# Well under peer_timeout_s (3 s) and transfer_timeout_s (10 s): only the
# acknowledgement rule can end these rooms this soon.
LOST_BOUND_S = 1.5


def _half_and_half(cluster):
    """Prefill TP 2 and decode TP 2 over 4 KV heads: decode rank d needs
    prefill rank d only."""
    prefills = [cluster.rank(Role.PREFILL, heads=2, total_heads=4, tp_rank=p, tp_size=2) for p in range(2)]
    decodes = [cluster.rank(Role.DECODE, heads=2, total_heads=4, tp_rank=d, tp_size=2) for d in range(2)]
    return prefills, decodes


def test_a_decode_rank_is_served_after_the_prefill_ranks_it_does_not_need_left(cluster):
    # The race of issue 25: the prefill ranks serving decode rank 0 finished
    # their rooms and closed (unregistering) before decode rank 1's first
    # lookup; the group was then "1 of 2 registered" for good, decode rank 1
    # never sent its requests and both sides waited out their timeouts.
    (p0, p1), (d0, d1) = _half_and_half(cluster)
    rng = np.random.default_rng(25)
    src, dst = random_pages(rng, 6), random_pages(rng, 6)
    sender, receiver = run_room(p0, d0, 1, src, dst)
    assert sender.poll() is KVPoll.Success and receiver.poll() is KVPoll.Success
    p0.mgr.close()
    sender, receiver = run_room(p1, d1, 1, src, dst)
    receiver.failure_exception()
    assert receiver.poll() is KVPoll.Success and sender.poll() is KVPoll.Success
    assert_landed(p1, d1, src, dst)


def test_a_room_that_needs_a_prefill_rank_that_left_fails_at_once_naming_it(cluster):
    (p0, p1), (d0, d1) = _half_and_half(cluster)
    rng = np.random.default_rng(26)
    run_room(p1, d1, 1, random_pages(rng, 4), random_pages(rng, 4))
    p0.mgr.close()
    receiver = KVReceiver(d0.mgr, p1.mgr.config.bootstrap_addr, 2)
    receiver.init(random_pages(rng, 4), 2)
    took = wait_until(d0.mgr, lambda: terminal(receiver), 5.0, what="the room failed")
    assert took < LOST_BOUND_S, f"{took:.2f} s"
    with pytest.raises(PeerError, match=r"prefill ranks \[0\] of prefill node 'prefill' dp 0 .* left") as info:
        receiver.failure_exception()
    assert failure_reason(info.value) is FailureReason.PEER_LOST


def test_a_request_lost_on_the_way_fails_both_sides_within_a_heartbeat_or_two(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(27)
    run_room(prefill, decode, 1, random_pages(rng, 4), random_pages(rng, 4))  # handshaken, watched
    cluster.fabric.drop_if(lambda m: isinstance(m, TransferRequest) and m.room == 2)
    sender = KVSender(prefill.mgr, None, 2)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 2)
    receiver.init(random_pages(rng, 4), 2)
    took = wait_until(decode.mgr, lambda: terminal(receiver, sender), 5.0, what="both sides failed")
    assert took < LOST_BOUND_S, f"{took:.2f} s (heartbeat {FAST['heartbeat_interval_s']} s)"
    with pytest.raises(PeerError, match="never took this room's request") as info:
        receiver.failure_exception()
    assert failure_reason(info.value) is FailureReason.REQUEST_LOST
    assert decode.mgr.rooms.num_lost_requests == 1 and len(decode.mgr.rooms.unacked) == 0
    with pytest.raises(PeerError, match="decode aborted the room"):
        sender.failure_exception()
    cluster.fabric.drop_if(None)  # the next room goes through
    src, dst = random_pages(rng, 4), random_pages(rng, 4)
    sender, receiver = run_room(prefill, decode, 3, src, dst)
    assert receiver.poll() is KVPoll.Success and decode.mgr.rooms.num_lost_requests == 1
    assert_landed(prefill, decode, src, dst)


def test_acknowledged_requests_are_never_taken_for_lost(cluster):
    # A prefill scheduler slower than many heartbeats: its rooms' requests
    # wait for their senders (acknowledged, not lost), then land.
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(28)
    src, dst = random_pages(rng, 4), random_pages(rng, 4)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 1)
    receiver.init(dst, 2)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Transferring, what="request sent")
    time.sleep(10 * FAST["heartbeat_interval_s"])  # ten heartbeats, each pong acknowledging what it took
    assert receiver.poll() is KVPoll.Transferring and decode.mgr.rooms.num_lost_requests == 0
    assert len(decode.mgr.rooms.unacked) == 0  # the kept request was acknowledged
    sender = KVSender(prefill.mgr, None, 1)
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.WaitingForInput, what="sender has the request")
    sender.init(len(src), 1)
    sender.send(src, last=True)
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    assert receiver.poll() is KVPoll.Success
    assert_landed(prefill, decode, src, dst)


def test_a_request_prefill_cannot_keep_is_refused_not_dropped(cluster, monkeypatch):
    # More rooms wait for their senders than prefill keeps: the oldest
    # request is refused, and its receiver fails at once instead of at its
    # transfer timeout.
    monkeypatch.setattr(prefill_table, "_EARLY_ROOMS", 2)
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(29)
    receivers = []
    for room in (1, 2, 3):
        r = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, room)
        r.init(random_pages(rng, 2), room)
        receivers.append(r)
        wait_until(decode.mgr, lambda: r.poll() is not KVPoll.Bootstrapping, what="request sent")
    took = wait_until(decode.mgr, lambda: terminal(receivers[0]), 5.0, what="the oldest room refused")
    assert took < LOST_BOUND_S
    with pytest.raises(PeerError, match="more than 2 rooms wait for their sender"):
        receivers[0].failure_exception()
    assert [r.poll() for r in receivers[1:]] == [KVPoll.Transferring] * 2
    assert prefill.mgr.rooms.num_dropped_early == 1 and decode.mgr.rooms.num_lost_requests == 0


def test_a_refused_layout_reaches_a_prefill_rank_that_registers_after_the_lookup(cluster):
    """Decode finds prefill's layout incompatible (another page size) while
    only prefill TP rank 0 of 2 is registered. Rank 1 registers later, its
    room waiting for decode's request: the refusal and the room's abort reach
    it too, within seconds, not at its 20 s bootstrap timeout; decode's room
    fails naming the field."""
    big = dict(bootstrap_timeout_s=20.0)
    p0 = cluster.rank(Role.PREFILL, heads=2, total_heads=4, tp_rank=0, tp_size=2, **big)
    d = cluster.rank(Role.DECODE, heads=4, total_heads=4, page_size=8, **big)
    s0 = KVSender(p0.mgr, None, 5)
    receiver = KVReceiver(d.mgr, cluster.server.address, 5)
    receiver.init(random_pages(np.random.default_rng(5), 2))
    time.sleep(0.5)  # decode looked rank 0 up: rank 1 is not there yet
    p1 = cluster.rank(Role.PREFILL, heads=2, total_heads=4, tp_rank=1, tp_size=2, **big)
    s1 = KVSender(p1.mgr, None, 5)
    took = wait_until(p1.mgr, lambda: s1.poll() is KVPoll.Failed, timeout_s=8.0, what="rank 1's room failed")
    assert took < 5.0
    wait_until(d.mgr, lambda: receiver.poll() is KVPoll.Failed and s0.poll() is KVPoll.Failed, timeout_s=5.0,
               what="decode's and rank 0's rooms failed")
    with pytest.raises(Exception, match="incompatible target.page_size"):
        receiver.failure_exception()
    with pytest.raises(PeerError, match="decode aborted the room"):
        s1.failure_exception()
