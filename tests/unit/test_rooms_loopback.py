"""The loopback pair's own faults and its control channel (the unit room
tests rely on them); the transport contract itself is checked for every
transport by tests/transport/test_conformance.py."""

import ctypes
import threading

import numpy as np
import pytest

from bootstrap import codec
from transfer.control.base import ChannelOptions
from transfer.errors import ClosedError, TransferError
from transfer.messages import PeerPing, RoomAbort
from transfer.plan import TransferPlan
from transfer.transport.loopback import LoopbackFabric


def _plan(*entries) -> TransferPlan:
    src, dst, n = zip(*entries)
    return TransferPlan(np.asarray(src, dtype=np.uint64), np.asarray(dst, dtype=np.uint64),
                        np.asarray(n, dtype=np.uint64))


class _Done:
    def __init__(self):
        self.calls, self.threads = [], []
        self.event = threading.Event()

    def __call__(self, error):
        self.calls.append(error)
        self.threads.append(threading.current_thread().name)
        self.event.set()

    def wait(self):
        assert self.event.wait(5), "callback never ran"
        return self.calls[0]


@pytest.fixture
def pair():
    fabric = LoopbackFabric()
    a, b = fabric.transport(), fabric.transport()
    src = (ctypes.c_uint8 * 4096).from_buffer_copy(np.random.default_rng(0).integers(0, 256, 4096, np.uint8))
    dst = (ctypes.c_uint8 * 4096)()
    a.register([(ctypes.addressof(src), 4096)])
    b.register([(ctypes.addressof(dst), 4096)])
    yield fabric, a, b, src, dst
    a.close()
    b.close()


def test_a_source_outside_the_registered_regions_is_a_transfer_error(pair):
    # (The transport contract's cases, every transport: tests/transport/test_conformance.py.
    # Checking the source is the loopback's own: Mooncake's TCP transport does not.)
    _, a, b, src, dst = pair
    s, d = ctypes.addressof(src), ctypes.addressof(dst)
    done = _Done()
    a.submit(b.session, _plan((s + 4000, d, 200)), done, None)
    error = done.wait()
    assert isinstance(error, TransferError) and "source" in str(error)
    assert set(bytes(dst)) == {0} and a.num_bytes == 0


def test_held_writes_can_be_cancelled_and_close_fails_what_is_queued(pair):
    fabric, a, b, src, dst = pair
    s, d = ctypes.addressof(src), ctypes.addressof(dst)
    fabric.hold_writes()
    first, second = _Done(), _Done()
    handle = a.submit(b.session, _plan((s, d, 8)), first, None)
    a.submit(b.session, _plan((s, d + 8, 8)), second, None)
    handle.cancel()
    fabric.release_writes()
    assert isinstance(first.wait(), TransferError) and set(bytes(dst[:8])) == {0}
    assert second.wait() is None
    fabric.hold_writes()
    third = _Done()
    a.submit(b.session, _plan((s, d, 8)), third, None)
    a.close()
    assert isinstance(third.wait(), TransferError) and len(third.calls) == 1
    with pytest.raises(ClosedError):
        a.submit(b.session, _plan((s, d, 8)), _Done(), None)


def test_writes_to_a_broken_or_unknown_peer_fail(pair):
    fabric, a, b, src, dst = pair
    fabric.break_writes(b.session)
    for peer in (b.session, "loopback:nobody"):
        done = _Done()
        a.submit(peer, _plan((ctypes.addressof(src), ctypes.addressof(dst), 8)), done, None)
        assert isinstance(done.wait(), TransferError)


def _channels(fabric, secret=None, other_secret=None):
    got = {"a": [], "b": []}
    events = {"a": threading.Event(), "b": threading.Event()}

    def handler(name):
        def on(msg, origin):
            assert origin == "127.0.0.1"  # the sending channel's host, as zmq's Peer-Address
            got[name].append(msg)
            events[name].set()
        return on

    return fabric.channel(ChannelOptions(host="127.0.0.1", secret=secret), handler("a")), \
        fabric.channel(ChannelOptions(host="127.0.0.1", secret=other_secret or secret), handler("b")), got, events


def test_messages_arrive_in_order_through_the_codec():
    fabric = LoopbackFabric()
    a, b, got, events = _channels(fabric, secret="s3cret")
    msgs = [PeerPing(session="x", endpoint=a.endpoint, seq=i) for i in range(50)]
    for m in msgs:
        a.send(b.endpoint, m)
    threading.Event().wait(0.2)
    assert got["b"] == msgs and b.num_received == 50
    fabric.inject(b.endpoint, b"\x00garbage")
    fabric.inject(b.endpoint, codec.encode(msgs[0]))  # not sealed
    _, open_b, open_got, _ = _channels(fabric)  # no secret
    fabric.inject(open_b.endpoint, b"\x00garbage")
    threading.Event().wait(0.2)
    assert (b.num_malformed, b.num_unauthenticated, b.num_received) == (0, 2, 52)
    assert (open_b.num_malformed, open_b.num_received, open_got["b"]) == (1, 1, [])
    a.close(), b.close()
    with pytest.raises(ClosedError):
        a.send(b.endpoint, msgs[0])


def test_held_cut_and_dropped_messages():
    fabric = LoopbackFabric()
    a, b, got, events = _channels(fabric)
    ping = PeerPing(session="x", endpoint=a.endpoint, seq=1)
    fabric.hold(b.endpoint)
    a.send(b.endpoint, ping)
    assert not events["b"].wait(0.1)
    fabric.release(b.endpoint)
    assert events["b"].wait(2) and got["b"] == [ping]
    fabric.cut(a.endpoint)
    b.send(a.endpoint, ping)
    a.send(b.endpoint, ping)
    fabric.drop_if(lambda m: isinstance(m, RoomAbort))
    fabric.mend(a.endpoint)
    a.send(b.endpoint, RoomAbort(room=1, request_id=2, reason="r"))
    a.send(b.endpoint, ping)
    threading.Event().wait(0.2)
    assert got == {"a": [], "b": [ping, ping]} and fabric.num_dropped == 3
    a.close(), b.close()
