"""Failures of rooms in one process over the loopback pair: refusals, abort
from either side, drain-before-fail (and a lost peer ending the drain),
storage fallback."""

import threading
import time

import numpy as np
import pytest

from transfer import KVPoll, KVReceiver, KVSender, KVTimeoutError, PeerError, StorageMissError
from transfer.rooms.decode_phases import DecodePhase

from ._rooms import Role, assert_landed, random_pages, run_room, terminal, transferring, wait_until


def test_a_request_after_the_sender_failed_is_refused_at_once(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    sender = KVSender(prefill.mgr, None, 5)
    sender.abort("the prefill scheduler dropped it")
    assert sender.poll() is KVPoll.Failed
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 5)
    receiver.init(random_pages(np.random.default_rng(0), 4), 2)
    took = wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="refusal")
    assert took < decode.mgr.config.bootstrap_timeout_s / 2  # refused, not timed out
    with pytest.raises(PeerError, match=r"ended \d+\.\d\d s before this request arrived"):
        receiver.failure_exception()


def test_prefill_abort_fails_decode_once_the_writes_stopped(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(1)
    src, dst = random_pages(rng, 16), random_pages(rng, 16)
    cluster.fabric.hold_writes()
    sender, receiver = transferring(prefill, decode, 6, src, dst)
    sender.abort()
    assert sender.poll() is KVPoll.Failed
    time.sleep(0.2)  # decode hears nothing while a write is in flight
    assert receiver.poll() is KVPoll.Transferring
    cluster.fabric.release_writes()
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="decode failed")
    with pytest.raises(PeerError, match="aborted by the prefill scheduler"):
        receiver.failure_exception()


def test_decode_abort_drains_before_it_reports_failed(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(2)
    src, dst = random_pages(rng, 16), random_pages(rng, 16)
    cluster.fabric.hold_writes()
    sender, receiver = transferring(prefill, decode, 8, src, dst)
    receiver.abort()
    assert receiver.phase is DecodePhase.DRAINING and receiver.poll() is KVPoll.Transferring
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.Failed, what="prefill hears the abort")
    with pytest.raises(PeerError, match="decode aborted the room"):
        sender.failure_exception()
    time.sleep(0.2)
    assert receiver.poll() is KVPoll.Transferring, "Failed while a prefill write may still land"
    assert receiver.ranks_writing() == {0}
    cluster.fabric.release_writes()
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="drain confirmed")
    assert receiver.phase is DecodePhase.FAILED


def test_a_lost_prefill_rank_ends_the_drain(cluster):
    """Decode aborts while a write is in flight, and the prefill rank is then
    unreachable: its silence (liveness), not the scheduler's polling, ends
    the drain."""
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE, heartbeat_interval_s=0.05,
                                                                peer_timeout_s=0.5)
    rng = np.random.default_rng(3)
    src, dst = random_pages(rng, 16), random_pages(rng, 16)
    cluster.fabric.hold_writes()
    sender, receiver = transferring(prefill, decode, 9, src, dst)
    cluster.fabric.cut(prefill.mgr.rank.control_endpoint)
    receiver.abort()
    assert receiver.phase is DecodePhase.DRAINING
    # No poll(): only the liveness thread can end the drain (poll's own bound
    # would too, but it runs in poll()).
    took = wait_until(decode.mgr, lambda: receiver.phase is DecodePhase.FAILED, what="peer lost")
    assert took < 3 * decode.mgr.config.peer_timeout_s
    assert receiver.poll() is KVPoll.Failed and receiver.ranks_writing() == set()
    cluster.fabric.release_writes()


def test_a_failed_transfer_is_restored_from_storage(cluster, tmp_path):
    store = dict(storage_url=f"file://{tmp_path / 'kv'}", model_name="test-model")
    prefill = cluster.rank(Role.PREFILL, **store)
    decode = cluster.rank(Role.DECODE, storage_prefetch="off", **store)
    rng = np.random.default_rng(4)
    num_pages = 12
    tokens = rng.integers(0, 50000, num_pages * 4)  # full pages only: all of them are stored
    src = random_pages(rng, num_pages)
    # Room 1 goes through and writes its pages through to storage.
    sender, receiver = run_room(prefill, decode, 30, src, random_pages(rng, num_pages), token_ids=tokens)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert prefill.mgr.storage.num_pages_written == num_pages
    # Room 2, same prompt: the transfer breaks; decode restores it from storage.
    cluster.fabric.break_writes(decode.mgr.rank.session)
    dst = random_pages(rng, num_pages)
    for t in (*decode.k, *decode.v, decode.aux):  # nothing of room 1 may pass for restored bytes
        t.zero_()
    sender2, receiver2 = run_room(prefill, decode, 31, src, dst, dst_aux=3, token_ids=tokens)
    assert sender2.poll() is KVPoll.Failed
    assert receiver2.poll() is KVPoll.Success, receiver2.failure_exception()
    assert receiver2.pages_from_storage == num_pages
    assert_landed(prefill, decode, src, dst, dst_aux=3)


def test_a_restore_with_pages_missing_fails_naming_them(cluster, tmp_path):
    store = dict(storage_url=f"file://{tmp_path / 'kv'}", model_name="test-model")
    prefill = cluster.rank(Role.PREFILL, storage_write_through=False, **store)
    decode = cluster.rank(Role.DECODE, storage_prefetch="off", **store)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 50000, 8 * 4)
    cluster.fabric.break_writes(decode.mgr.rank.session)
    sender, receiver = run_room(prefill, decode, 32, random_pages(rng, 8), random_pages(rng, 8), token_ids=tokens)
    assert receiver.poll() is KVPoll.Failed
    with pytest.raises(StorageMissError, match=r"target pages \[0, 8\) not in storage"):
        receiver.failure_exception()


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_a_failure_with_a_write_in_flight_says_where_the_write_stands(cluster, path):
    """What a reader needs at 3 a.m. to tell a stuck write from a lost message:
    prefill's failure names the held write (or staged part), its peer, and
    the transport worker's state; decode's names its staging."""
    staged = dict(staging_bytes=1 << 20, stage_part_bytes=4096, stage_below_bytes=1 << 20, write_fence=False)
    extra = staged if path == "staged" else {}
    prefill, decode = cluster.rank(Role.PREFILL, **extra), cluster.rank(Role.DECODE, **extra)
    rng = np.random.default_rng(11)
    src, dst = random_pages(rng, 16), random_pages(rng, 16)
    cluster.fabric.hold_writes()
    sender, receiver = transferring(prefill, decode, 12, src, dst)
    receiver.abort()
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.Failed, what="prefill hears the abort")
    with pytest.raises(PeerError) as caught:
        sender.failure_exception()
    text = str(caught.value)
    session = decode.mgr.rank.session
    assert "prefill then: Transferring" in text and "write(s) in flight" in text, text
    assert f"write to {session} of " in text and "not copied yet" in text and "transport's" in text, text
    if path == "staged":
        assert "staged part 0 (" in text, text
    cluster.fabric.release_writes()
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="drain confirmed")


def test_a_decode_timeout_names_its_rooms_staging(cluster):
    staged = dict(staging_bytes=1 << 20, stage_part_bytes=4096, stage_below_bytes=1 << 20, write_fence=False)
    prefill = cluster.rank(Role.PREFILL, **staged)
    decode = cluster.rank(Role.DECODE, transfer_timeout_s=1.0, **staged)
    rng = np.random.default_rng(12)
    src, dst = random_pages(rng, 16), random_pages(rng, 16)
    cluster.fabric.hold_writes()
    sender, receiver = transferring(prefill, decode, 13, src, dst)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="decode's transfer timeout")
    with pytest.raises(KVTimeoutError) as caught:
        receiver.failure_exception()
    assert "no completion from prefill ranks [0]" in str(caught.value)
    assert "staging: 2 part region(s) granted, 0 room region(s) granted with the request" in str(caught.value)
    cluster.fabric.release_writes()


def test_a_room_asked_of_a_killed_prefill_rank_asks_the_restarted_node(cluster, monkeypatch):
    """A prefill rank killed (no goodbye) and started again before decode's
    liveness saw it go: the next room takes the old, still ready link and its
    request goes nowhere. Once the old address refuses connections, the room
    (whose request no rank took, and no byte landed) looks the node up again
    and asks the new rank, under a new request id: it succeeds, byte-exact,
    and is counted (``rooms_relinked``); the scheduler saw Transferring all along."""
    from transfer.control.base import Link
    from transfer.messages import PeerBye

    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(11)
    src, dst = random_pages(rng, 8), random_pages(rng, 8)
    assert all(e.poll() is KVPoll.Success for e in run_room(prefill, decode, 40, src, dst))
    old = prefill.mgr.rank.control_endpoint
    seen_dead = threading.Event()
    real_link = cluster.fabric.link
    monkeypatch.setattr(cluster.fabric, "link", lambda s, d: Link.UP if d == old and not seen_dead.is_set()
                        else real_link(s, d))
    cluster.fabric.drop_if(lambda m: isinstance(m, PeerBye))  # killed: it says no goodbye
    prefill.mgr.close()
    cluster.fabric.drop_if(None)
    restarted = cluster.rank(Role.PREFILL)
    sender = KVSender(restarted.mgr, None, 41)
    src, dst = random_pages(rng, 8), random_pages(rng, 8)
    receiver = KVReceiver(decode.mgr, decode.mgr.config.bootstrap_addr, 41)
    receiver.init(dst, 2)
    wait_until(decode.mgr, lambda: receiver.phase is DecodePhase.TRANSFERRING, what="request sent")
    first_id = receiver.request_id
    seen = []
    seen_dead.set()  # liveness now finds the old address refusing connections
    wait_until(decode.mgr, lambda: seen.append(receiver.poll()) or receiver.phase is not DecodePhase.TRANSFERRING
               or receiver.request_id != first_id, what="room relinked")
    wait_until(restarted.mgr, lambda: sender.poll() is not KVPoll.Bootstrapping, what="restarted rank asked")
    sender.init(len(src), 1)
    sender.send(src, last=True)
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert receiver.request_id != first_id
    assert_landed(restarted, decode, src, dst)
    assert decode.mgr.stats().rooms_relinked == 1
    assert set(seen) == {KVPoll.Transferring}
