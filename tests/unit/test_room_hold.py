"""RoomHold (decode holds a room whose request waits in its queue): the
prefill room waits for decode requests past ``bootstrap_timeout_s`` until
the hold ends, then fails saying it was held; holds for unknown rooms and
from decode ranks that did not handshake change nothing; only decode ranks
hold."""

from __future__ import annotations

import time

import pytest

from transfer import KVPoll, KVSender, Role
from transfer.errors import KVTimeoutError, StateError
from transfer.messages import RoomHold

from ._rooms import wait_until


def hold(decode, cluster, room: int, hold_s: float) -> None:
    wait_until(decode.mgr, lambda: decode.mgr.hold_room(cluster.server.address, room, hold_s=hold_s), 5,
               what=f"room {room} held (the prefill node looked up)")


def test_a_hold_keeps_the_room_waiting_past_the_bootstrap_bound_then_it_times_out(cluster):
    prefill = cluster.rank(Role.PREFILL, bootstrap_timeout_s=0.5)
    decode = cluster.rank(Role.DECODE)
    sender = KVSender(prefill.mgr, None, 41)
    sender.init(2)
    hold(decode, cluster, 41, 2.0)
    held_at = time.monotonic()
    hold(decode, cluster, 999, 2.0)  # no such room at prefill: ignored
    wait_until(prefill.mgr, lambda: prefill.mgr.rooms.num_holds >= 2, 5, what="both holds taken")
    time.sleep(1.0)
    assert sender.poll() is KVPoll.Bootstrapping, "the held room ended at bootstrap_timeout_s"
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.Failed, 5, what="the room failed")
    assert time.monotonic() - held_at >= 1.9
    with pytest.raises(KVTimeoutError, match=r"0 decode request\(s\) arrived within 0.5 s \(decode held it"):
        sender.failure_exception()


def test_a_hold_from_a_rank_that_did_not_handshake_is_ignored(cluster):
    prefill = cluster.rank(Role.PREFILL, bootstrap_timeout_s=0.5)
    sender = KVSender(prefill.mgr, None, 42)
    sender.init(1)
    prefill.mgr.rooms.on_message(RoomHold(room=42, session="10.9.9.9:1", hold_s=60.0), "tcp://10.9.9.9:2")
    assert sender.held_until == 0.0 and prefill.mgr.rooms.num_holds == 0
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.Failed, 5, what="the room failed")


def test_only_decode_ranks_hold(cluster):
    prefill = cluster.rank(Role.PREFILL)
    with pytest.raises(StateError, match="hold_room is for decode ranks"):
        prefill.mgr.hold_room(cluster.server.address, 1, hold_s=1.0)
