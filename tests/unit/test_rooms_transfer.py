"""Prefill and decode rooms in one process over the loopback pair: normal
rooms, early requests, staged parts. Bytes compared exactly."""

import numpy as np
import pytest
import torch

from ._rooms import Role, assert_landed, random_pages, run_room, wait_until
from transfer import IncompatibleLayoutError, KVPoll, KVReceiver, KVSender, PeerError
from transfer.rooms.decode_phases import DecodePhase


@pytest.mark.parametrize("seed", [1, 2])
def test_a_room_lands_byte_exact(cluster, seed):
    rng = np.random.default_rng(seed)
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    src, dst = random_pages(rng, 24), random_pages(rng, 24)
    sender, receiver = run_room(prefill, decode, 7, src, dst, chunks=int(rng.integers(1, 5)))
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert_landed(prefill, decode, src, dst)
    untouched = np.setdiff1d(np.arange(64), dst)
    assert set(b"".join(decode.page_bytes(untouched))) == {0}, "bytes outside the room's pages changed"
    assert prefill.mgr.transport.num_bytes > 0 and decode.mgr.channel.num_received > 0


def test_an_early_request_waits_for_its_sender(cluster):
    """Decode's request reaches prefill before the scheduler made the sender:
    the sender takes it over on creation, and is ready at once."""
    rng = np.random.default_rng(3)
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    src, dst = random_pages(rng, 10), random_pages(rng, 10)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 11)
    receiver.init(dst, 2)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Transferring, what="request sent")
    assert receiver.phase is DecodePhase.TRANSFERRING
    # The request is on its way or kept; delivery is asynchronous: wait for the channel.
    wait_until(prefill.mgr, lambda: prefill.mgr.channel.num_received >= 2, what="request delivered")
    sender = KVSender(prefill.mgr, None, 11)
    assert sender.poll() is KVPoll.WaitingForInput  # no Bootstrapping: the early request was kept
    sender.init(len(src), 1)
    sender.send(src, last=True)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Success and sender.poll() is KVPoll.Success)
    assert_landed(prefill, decode, src, dst)


def test_staged_parts_gather_write_and_scatter(cluster):
    """Scattered pages with staging on both sides go as staged parts (a few
    large writes), and land exactly. (Fence off: the aux row is a direct
    write, counted below; fenced rooms are in test_rooms_fence.py.)"""
    staged = dict(staging_bytes=1 << 20, stage_part_bytes=4096, stage_below_bytes=1 << 20, write_fence=False)
    prefill, decode = cluster.rank(Role.PREFILL, **staged), cluster.rank(Role.DECODE, **staged)
    rng = np.random.default_rng(4)
    src, dst = random_pages(rng, 30), random_pages(rng, 30)
    sender, receiver = run_room(prefill, decode, 21, src, dst, chunks=2)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert_landed(prefill, decode, src, dst)
    # 30 scattered pages x 4 buffers would take ~120 direct descriptors; 1 KiB
    # per page staged in parts of 4 KiB: 8 part writes and the aux row.
    assert prefill.mgr.transport.num_descriptors == 8 + 1
    for rank in (prefill, decode):
        area = rank.mgr.context.staging.area
        wait_until(rank.mgr, lambda: area.free_bytes == area.nbytes, what="staging regions freed")


def test_staging_is_skipped_when_the_peer_has_none(cluster):
    prefill = cluster.rank(Role.PREFILL, staging_bytes=1 << 20, stage_part_bytes=4096, stage_below_bytes=1 << 20)
    decode = cluster.rank(Role.DECODE)
    rng = np.random.default_rng(5)
    src, dst = random_pages(rng, 6), random_pages(rng, 6)
    sender, receiver = run_room(prefill, decode, 22, src, dst, chunks=1)
    assert receiver.poll() is KVPoll.Success
    assert_landed(prefill, decode, src, dst)
    assert prefill.mgr.transport.num_descriptors > 8  # direct: per page run and buffer


def test_two_prefill_tp_ranks_fill_one_decode_rank_head_slices(cluster):
    """Prefill TP 2 (2 of 4 KV heads each) into decode TP 1: each prefill rank
    gets its own request and writes its heads of every page; one sends the aux row."""
    prefills = [cluster.rank(Role.PREFILL, heads=2, total_heads=4, tp_rank=p, tp_size=2) for p in range(2)]
    decode = cluster.rank(Role.DECODE, heads=4, total_heads=4)
    rng = np.random.default_rng(6)
    src, dst = random_pages(rng, 9), random_pages(rng, 9)
    receiver = KVReceiver(decode.mgr, prefills[0].mgr.config.bootstrap_addr, 40)
    receiver.init(dst, 2)
    senders = [KVSender(p.mgr, None, 40) for p in prefills]
    for s in senders:
        wait_until(decode.mgr, lambda: s.poll() is KVPoll.WaitingForInput, what="both requests arrived")
    for s in senders:
        s.init(len(src), 1)
        s.send(src, last=True)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Success and
               all(s.poll() is KVPoll.Success for s in senders), what="room done")
    idx = torch.as_tensor(dst)
    for p, prefill in enumerate(prefills):
        for mine, theirs in zip((*decode.k, *decode.v), (*prefill.k, *prefill.v)):
            got = mine.index_select(0, idx)[:, :, 2 * p:2 * p + 2, :]
            assert got.contiguous().view(torch.uint8).numpy().tobytes() == \
                theirs.index_select(0, torch.as_tensor(src)).view(torch.uint8).numpy().tobytes()
    assert decode.aux_bytes(2) in (prefills[0].aux_bytes(1), prefills[1].aux_bytes(1))
    assert sum(p.mgr.transport.num_descriptors > 0 for p in prefills) == 2


def test_an_incompatible_decode_rank_fails_naming_the_field(cluster):
    prefill = cluster.rank(Role.PREFILL)
    decode = cluster.rank(Role.DECODE, page_size=8)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 41)
    receiver.init(random_pages(np.random.default_rng(7), 3), 2)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="handshake refused")
    with pytest.raises(IncompatibleLayoutError, match="page_size"):
        receiver.failure_exception()


def test_a_decode_abort_before_the_sender_exists_is_confirmed_at_once(cluster):
    """Decode aborts a room whose request is kept early on prefill: nothing
    was written, prefill says so, and the room is Failed without waiting
    for a drain bound; the sender created later learns of the abort."""
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 42)
    receiver.init(random_pages(np.random.default_rng(8), 3), 2)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Transferring, what="request sent")
    wait_until(prefill.mgr, lambda: prefill.mgr.channel.num_received >= 2, what="request delivered")
    receiver.abort()
    took = wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="abort confirmed")
    assert took < decode.mgr.config.peer_timeout_s / 2
    sender = KVSender(prefill.mgr, None, 42)
    assert sender.poll() is KVPoll.Failed
    with pytest.raises(PeerError, match="decode aborted the room"):
        sender.failure_exception()
