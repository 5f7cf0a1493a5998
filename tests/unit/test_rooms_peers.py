"""Who may take part in a room, over the loopback pair: hellos that declare
another rank's identity, requests from outsiders, duplicate receivers and
replays; decode failures before the link is known reach prefill; fast
bootstrap errors; close() tells peers before the channel closes."""

import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from bootstrap import codec
from transfer.control.base import ChannelOptions
from transfer import (BootstrapRefused, ClosedError, KVFerryError, KVPoll, KVReceiver, KVSender, PageIndexError,
                      PeerError, RequestError)
from transfer.messages import PeerHello, PeerHelloReply, RoomAbort, TransferRequest

from ._rooms import NUM_PAGES, Role, assert_landed, random_pages, run_room, wait_until


class _Listener:
    """A bare channel on the fabric that keeps what it receives."""

    def __init__(self, fabric) -> None:
        self.got, self.event = [], threading.Event()
        self.channel = fabric.channel(ChannelOptions(host="127.0.0.1"), self._on)

    def _on(self, msg, origin) -> None:
        self.got.append(msg)
        self.event.set()

    def reply(self, timeout_s: float = 5.0) -> PeerHelloReply:
        assert self.event.wait(timeout_s), "no reply"
        return self.got[-1]


def _hello(cluster, prefill, rank, origin="127.0.0.1"):
    """Send a hand-made PeerHello declaring ``rank`` (its replies to a listener)."""
    listener = _Listener(cluster.fabric)
    hello = PeerHello(rank=replace(rank, control_endpoint=listener.channel.endpoint), allow_missing_draft=False)
    cluster.fabric.inject(prefill.mgr.rank.control_endpoint, codec.encode(hello), origin=origin)
    return listener.reply()


def test_a_hello_declaring_the_prefills_own_session_is_refused_and_counted(cluster):
    prefill = cluster.rank(Role.PREFILL)
    reply = _hello(cluster, prefill, prefill.mgr.rank)
    assert not reply.ok and reply.field == "session" and "own transfer session" in reply.reason
    assert prefill.mgr.rooms.num_refused_hellos == 1
    assert prefill.mgr.rank.session not in prefill.mgr.rooms.peers


def test_a_hello_declaring_a_sibling_prefill_rank_is_refused(cluster):
    prefills = [cluster.rank(Role.PREFILL, heads=1, total_heads=2, tp_rank=p, tp_size=2) for p in range(2)]
    sibling = prefills[1].mgr.rank.session
    # learned from the bootstrap server by the registration thread
    wait_until(prefills[0].mgr, lambda: sibling in prefills[0].mgr.rooms.prefill_sessions, what="siblings known")
    reply = _hello(cluster, prefills[0], replace(prefills[1].mgr.rank))
    assert not reply.ok and "another prefill rank of this node" in reply.reason
    assert prefills[0].mgr.rooms.num_refused_hellos == 1


def test_a_hello_from_another_host_than_its_session_is_refused_unless_the_check_is_off(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    reply = _hello(cluster, prefill, decode.mgr.rank, origin="10.1.2.3")
    assert not reply.ok and "came from 10.1.2.3" in reply.reason
    assert prefill.mgr.rooms.num_refused_hellos == 1
    assert _hello(cluster, prefill, decode.mgr.rank).ok  # from its own host: fine
    lax = cluster.rank(Role.PREFILL, check_peer_host=False)
    assert _hello(cluster, lax, decode.mgr.rank, origin="10.1.2.3").ok


def _request(decode, room, request_id, *, session=None, tp_rank=0, num_pages=4):
    rank = decode.mgr.rank
    return TransferRequest(room=room, request_id=request_id, decode_session=session or rank.session,
                           decode_endpoint=rank.control_endpoint, decode_tp_rank=tp_rank,
                           dst_pages=np.arange(num_pages, dtype="<i4").tobytes(), dst_aux_index=-1, assignments=(),
                           num_requests=1)


def test_outsiders_cannot_end_a_room(cluster):
    """Requests and aborts from a session that never handshook are dropped
    and counted; the room then goes through for its own decode rank."""
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    sender = KVSender(prefill.mgr, None, 7)
    endpoint = prefill.mgr.rank.control_endpoint
    cluster.fabric.inject(endpoint, codec.encode(_request(decode, 7, 99, session="127.0.0.1:1")))
    cluster.fabric.inject(endpoint, codec.encode(RoomAbort(room=7, request_id=98, reason="x", session="127.0.0.1:1")))
    cluster.fabric.inject(endpoint, codec.encode(_request(decode, 8, 99, session="127.0.0.1:1")))  # no sender yet
    rooms = prefill.mgr.rooms
    wait_until(prefill.mgr, lambda: rooms.num_refused_unhandshaken == 2 and rooms.num_refused_aborts == 1,
               what="counted")
    assert sender.poll() is KVPoll.Bootstrapping
    rng = np.random.default_rng(11)
    src, dst = random_pages(rng, 6), random_pages(rng, 6)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 7)
    receiver.init(dst, 2)
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.WaitingForInput, what="its own request")
    sender.init(len(src), 1)
    sender.send(src, last=True)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Success, what="room done")
    assert_landed(prefill, decode, src, dst)


@pytest.mark.parametrize("sender_first", [True, False], ids=["live-sender", "early-requests"])
def test_duplicate_receivers_are_refused_at_once_and_the_room_goes_on(cluster, sender_first):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(12)
    src, dst = random_pages(rng, 5), random_pages(rng, 5)
    sender = KVSender(prefill.mgr, None, 9) if sender_first else None
    first = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 9)
    first.init(dst, 2)
    wait_until(decode.mgr, lambda: first.poll() is KVPoll.Transferring, what="first request sent")
    dups = [KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 9) for _ in range(3)]
    start = time.monotonic()
    for d in dups:
        d.init(random_pages(rng, 5), 3)
    took = wait_until(decode.mgr, lambda: all(d.poll() is KVPoll.Failed for d in dups), what="refused")
    assert took < 1.0 and time.monotonic() - start < 1.5
    why = "has all the 1 decode request" if sender_first else "already has a request from decode TP rank 0"
    with pytest.raises(PeerError, match=f"refused this request: it {why}"):
        dups[0].failure_exception()
    assert prefill.mgr.rooms.num_refused_duplicates == 3
    sender = sender or KVSender(prefill.mgr, None, 9)
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(len(src), 1)
    sender.send(src, last=True)
    wait_until(decode.mgr, lambda: first.poll() is KVPoll.Success, what="room done")
    assert sender.poll() is KVPoll.Success
    assert_landed(prefill, decode, src, dst)


def test_a_replayed_request_is_dropped_and_counted(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(13)
    sender, receiver = run_room(prefill, decode, 10, random_pages(rng, 4), random_pages(rng, 4))
    assert receiver.poll() is KVPoll.Success
    replay = _request(decode, 10, receiver.request_id)
    cluster.fabric.inject(prefill.mgr.rank.control_endpoint, codec.encode(replay))
    wait_until(prefill.mgr, lambda: prefill.mgr.rooms.num_dropped_replays == 1, what="replay dropped")
    assert 10 not in prefill.mgr.rooms.senders and not prefill.mgr.rooms._early


@pytest.mark.parametrize("warm", [False, True], ids=["link-unknown", "link-known"])
def test_an_abort_before_the_first_poll_reaches_prefill_within_a_second(cluster, warm):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(14)
    if warm:
        run_room(prefill, decode, 1, random_pages(rng, 3), random_pages(rng, 3))
    sender = KVSender(prefill.mgr, None, 11)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 11)
    receiver.abort()
    assert receiver.poll() is KVPoll.Failed
    took = wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.Failed, what="prefill told")
    assert took < 1.0, f"prefill heard of the abort after {took:.2f} s"
    with pytest.raises(PeerError, match="decode aborted the room"):
        sender.failure_exception()


def test_page_ids_outside_the_pool_fail_both_sides_within_a_second(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    sender = KVSender(prefill.mgr, None, 12)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 12)
    receiver.init(np.array([1, NUM_PAGES + 5]), 2)
    assert receiver.poll() is KVPoll.Failed
    with pytest.raises(PageIndexError) as info:
        receiver.failure_exception()
    assert isinstance(info.value, IndexError) and isinstance(info.value, KVFerryError)
    took = wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.Failed, what="prefill told")
    assert took < 1.0


def test_more_pages_than_init_said_is_a_request_error(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(15)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 13)
    receiver.init(random_pages(rng, 4), 2)
    sender = KVSender(prefill.mgr, None, 13)
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(4, 1)
    sender.send(random_pages(rng, 6), last=True)
    assert sender.poll() is KVPoll.Failed
    with pytest.raises(RequestError, match="6 pages sent, more than the 4 of init"):
        sender.failure_exception()
    with pytest.raises(ValueError):  # still what callers caught before
        sender.failure_exception()
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="decode told")


def test_an_unreachable_bootstrap_server_fails_the_room_in_well_under_a_second(cluster):
    decode = cluster.rank(Role.DECODE)
    receiver = KVReceiver(decode.mgr, "127.0.0.1:1", 14)  # nothing listens on port 1
    receiver.init(random_pages(np.random.default_rng(16), 3), 2)
    took = wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="refused")
    assert took < 0.8
    with pytest.raises(BootstrapRefused, match="refused the connection"):
        receiver.failure_exception()


def test_close_tells_decode_before_the_channel_closes(cluster):
    """A prefill rank closes with a write in flight: decode hears the
    failure at once (not from liveness), and forgets the link."""
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(17)
    src, dst = random_pages(rng, 8), random_pages(rng, 8)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 15)
    receiver.init(dst, 2)
    sender = KVSender(prefill.mgr, None, 15)
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.WaitingForInput)
    cluster.fabric.hold_writes()
    sender.init(len(src), 1)
    sender.send(src[:4])
    start = time.monotonic()
    prefill.mgr.close()
    cluster.fabric.release_writes()
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="decode told")
    assert time.monotonic() - start < 1.0 < decode.mgr.config.peer_timeout_s  # told, not found silent
    with pytest.raises(PeerError, match="manager closed"):
        receiver.failure_exception()
    wait_until(decode.mgr, lambda: not decode.mgr.rooms.links.links, what="link forgotten (PeerBye)")
    with pytest.raises(ClosedError):
        prefill.mgr.check_open()


def test_the_identity_rule():
    from transfer.rooms.peer_check import identity_problem, same_host, session_host

    assert session_host("[::1]:15001") == "::1" and session_host("10.0.0.2:15001") == "10.0.0.2"
    assert same_host("127.0.0.1:1", "::ffff:127.0.0.1") and same_host("localhost:1", "127.0.0.1")
    assert not same_host("10.0.0.2:1", "10.0.0.3")
    rule = dict(own_session="10.0.0.1:1", prefill_sessions={"10.0.0.1:2"}, check_host=True)
    assert "own" in identity_problem("10.0.0.1:1", "10.0.0.1", **rule)
    assert "another prefill rank" in identity_problem("10.0.0.1:2", "10.0.0.1", **rule)
    assert "came from 10.0.0.9" in identity_problem("10.0.0.2:7", "10.0.0.9", **rule)
    assert identity_problem("10.0.0.2:7", "10.0.0.2", **rule) == ""
    assert identity_problem("10.0.0.2:7", "10.0.0.9", **{**rule, "check_host": False}) == ""
    assert identity_problem("10.0.0.2:7", "", **rule) == ""  # a channel that cannot tell


def test_an_incompatible_decode_rank_fails_the_prefill_room_too_naming_the_field(cluster):
    """Refused for its layout, a decode rank is no outsider: its abort of a
    room that awaits it is taken, and prefill learns the field at once."""
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE, page_size=8)
    sender = KVSender(prefill.mgr, None, 16)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 16)
    receiver.init(random_pages(np.random.default_rng(18), 3), 2)
    took = wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.Failed, what="prefill told")
    assert took < 1.0 and receiver.poll() is KVPoll.Failed
    with pytest.raises(PeerError, match="page_size"):
        sender.failure_exception()
