"""Prefill and decode rooms in one process over the loopback pair: normal
rooms, early requests, staged parts. Bytes compared exactly."""

import numpy as np
import pytest

from ._rooms import Role, assert_landed, cluster, random_pages, run_room, wait_until  # noqa: F401
from transfer import KVPoll, KVReceiver, KVSender
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
    large writes), and land exactly."""
    staged = dict(staging_bytes=1 << 20, stage_part_bytes=4096, stage_below_bytes=1 << 20)
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
