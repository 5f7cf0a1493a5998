"""The bootstrap server as a separate process: registration, not-ready
lookups, and bad input that gets an error reply while the server goes on."""

import contextlib
import dataclasses
import socket
import time

import msgpack
import pytest
import zmq

from bootstrap import codec
from bootstrap.client import BootstrapClient
from bootstrap.errors import BootstrapError, BootstrapRefused, BootstrapUnavailable
from bootstrap.messages import (AttentionKind, BufferRef, Component, ErrorReply, Lookup, PageLayout, PoolDescriptor,
                                PoolRole, RankInfo)
from harness.http_probe import CURL_GET, SHORT_GET, send_http
from harness.launch import BootstrapProcess
from harness.ports import refusing_address

pytestmark = [pytest.mark.e2e, pytest.mark.transport_free]


def _rank(tp_rank: int, tp_size: int = 2, node: str = "p0") -> RankInfo:
    pool = PoolDescriptor(role=PoolRole.TARGET, attention=AttentionKind.MHA, dtype="bfloat16", itemsize=2,
                          page_size=16, num_pages=4, num_layers=1, num_kv_heads=4, total_kv_heads=8, head_dim=8,
                          page_layout=PageLayout.NHD,
                          buffers=(BufferRef(layer=0, component=Component.K, addr=4096, nbytes=4 * 1024),
                                   BufferRef(layer=0, component=Component.V, addr=8192, nbytes=4 * 1024)))
    return RankInfo(node_id=node, dp_rank=0, dp_size=1, tp_rank=tp_rank, tp_size=tp_size,
                    session=f"127.0.0.1:{1000 + tp_rank}", control_endpoint=f"tcp://127.0.0.1:{2000 + tp_rank}",
                    pools=(pool,), aux=None)


def _raw(address: str, frames: list[bytes], timeout_ms: int = 3000) -> list[bytes]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(f"tcp://{address}")
    try:
        sock.send_multipart(frames)
        return sock.recv_multipart()
    finally:
        sock.close()


def test_lookup_not_ready_until_every_rank_registered(bootstrap_server):
    with BootstrapClient(bootstrap_server.address, timeout_s=5) as client:
        early = client.lookup("p0", 0)
        assert not early.ready and early.num_registered == 0 and early.ranks == ()
        assert client.register(_rank(1)).num_registered == 1
        half = client.lookup("p0", 0)
        assert not half.ready and half.num_registered == 1 and half.tp_size == 2
        client.register(_rank(0))
        full = client.lookup("p0", 0)
        assert full.ready and [r.tp_rank for r in full.ranks] == [0, 1]
        assert full.ranks[1] == _rank(1)


def test_partial_lookups_follow_every_change_of_the_group(bootstrap_server):
    # Replies that list ranks are encoded once per version of their node: a
    # cached one must never outlive a registration or a departure.
    with BootstrapClient(bootstrap_server.address, timeout_s=5) as client:
        client.register(_rank(1))
        for _ in range(2):
            half = client.lookup("p0", 0, partial=True)
            assert not half.ready and [r.tp_rank for r in half.ranks] == [1] and half.departed == ()
        client.register(_rank(0))
        assert client.lookup("p0", 0, partial=True).ready
        assert client.unregister(_rank(0)).removed
        for _ in range(2):
            left = client.lookup("p0", 0, partial=True)
            assert not left.ready and [r.tp_rank for r in left.ranks] == [1] and left.departed == (0,)
        assert client.lookup("p0", 0).ranks == ()  # a plain lookup lists no partial group


@pytest.mark.parametrize("payload,expect", [
    (b"\xc1\xff not msgpack", "not a msgpack message"),
    (msgpack.packb([1, 2, 3]), "envelope must be a map"),
    (msgpack.packb({"v": 99, "kind": "lookup", "body": {"node_id": "p0", "dp_rank": 0}}), "protocol version 99"),
    (msgpack.packb({"v": codec.PROTOCOL_VERSION, "kind": "steal_kv", "body": {}}), "unknown message kind"),
    (msgpack.packb({"v": codec.PROTOCOL_VERSION, "kind": "lookup", "body": {"node_id": "p0"}}), "missing field 'dp_rank'"),
    (msgpack.packb({"v": codec.PROTOCOL_VERSION, "kind": "lookup", "body": {"node_id": "p0", "dp_rank": "0"}}),
     "lookup.dp_rank: expected int, got str"),
    (codec.encode(ErrorReply(code="x", message="y")), "does not serve 'error'"),
])
def test_malformed_request_gets_error_reply_and_server_keeps_serving(bootstrap_server, payload, expect):
    reply = codec.decode(_raw(bootstrap_server.address, [payload])[-1])
    assert isinstance(reply, ErrorReply) and reply.code == "protocol"
    assert expect in reply.message, reply.message
    with BootstrapClient(bootstrap_server.address, timeout_s=5) as client:
        client.register(_rank(0, tp_size=1, node="after"))
        assert client.lookup("after", 0).ready
        assert client.ping().num_errors >= 1


def test_conflicting_registration_is_refused_and_named(bootstrap_server):
    with BootstrapClient(bootstrap_server.address, timeout_s=5) as client:
        client.register(_rank(0, tp_size=2))
        with pytest.raises(BootstrapError, match="tp_size 4 differs from 2") as info:
            client.register(_rank(1, tp_size=4))
        assert info.value.code == "conflict"
        assert client.lookup("p0", 0).num_registered == 1


def test_extra_frames_get_an_error_reply(bootstrap_server):
    reply = codec.decode(_raw(bootstrap_server.address, [b"a", b"b", b"c"])[-1])
    assert isinstance(reply, ErrorReply) and "expected 1 payload frame" in reply.message
    with BootstrapClient(bootstrap_server.address, timeout_s=5) as client:
        assert client.request(Lookup(node_id="x", dp_rank=0)).ready is False


def test_unreachable_server_times_out_with_a_clear_error():
    # Something listens (a bare TCP socket that never speaks): only the timeout can tell.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with BootstrapClient(address, timeout_s=0.3) as client:
            with pytest.raises(BootstrapUnavailable, match="did not answer 'ping' within 0.3 s") as info:
                client.ping()
            assert not isinstance(info.value, BootstrapRefused)


def test_closed_port_is_refused_within_well_under_a_second():
    with refusing_address() as address, BootstrapClient(address, timeout_s=5) as client:
        for call in (client.ping, lambda: client.lookup("p0", 0)):  # the first request and a later one
            start = time.monotonic()
            with pytest.raises(BootstrapRefused, match=f"bootstrap server {address} refused the connection "
                                                       r"\(nothing listens there\)"):
                call()
            assert time.monotonic() - start < 1.0


def test_server_gone_after_serving_is_refused_fast():
    server = BootstrapProcess()
    with BootstrapClient(server.address, timeout_s=5) as client:
        assert client.ping().num_nodes == 0
        server.close()
        start = time.monotonic()
        with pytest.raises(BootstrapRefused):
            client.ping()
        assert time.monotonic() - start < 1.0


def test_lookup_replies_follow_reregistration_unregistration_and_expiry():
    # The server encodes a ready reply once per change of its node: every change must show.
    with BootstrapProcess(extra_args=("--rank-ttl", "1")) as server:
        with BootstrapClient(server.address, timeout_s=5) as client:
            client.register(_rank(0))
            client.register(_rank(1))
            client.register(_rank(0, tp_size=1, node="other"))
            first = client.lookup("p0", 0)
            assert first.ready and client.lookup("p0", 0) == first
            moved = dataclasses.replace(_rank(1), control_endpoint="tcp://127.0.0.1:2999")
            client.register(moved)
            assert client.lookup("p0", 0).ranks[1].control_endpoint == "tcp://127.0.0.1:2999"
            client.register(_rank(0, tp_size=1, node="other"))  # another node's change keeps p0's reply right
            assert client.lookup("p0", 0).ranks == (_rank(0), moved)
            client.unregister(moved)
            assert not client.lookup("p0", 0).ready
            client.register(moved)
            assert client.lookup("p0", 0).ready
            time.sleep(1.5)  # nobody re-registers: expired
            gone = client.lookup("p0", 0)
            assert not gone.ready and gone.dp_size == 0


@pytest.mark.parametrize("secret", [None, "s3cret"], ids=["bare", "sealed"])
def test_a_periodic_caller_decodes_a_reply_only_when_it_changed(secret):
    """A re-registering rank sends its registration packed once, and an
    unchanged reply is not decoded again (the same frozen object comes back);
    every change still shows, sealed frames included."""
    with BootstrapProcess(secret=secret) as server, \
            BootstrapClient(server.address, timeout_s=5, secret=secret) as client:
        rank = _rank(0)
        client.register(rank)
        packed = client._registration[1]
        assert client.register(rank).num_registered == 1 and client._registration[1] is packed
        first = client.lookup("p0", 0, partial=True)
        assert client.lookup("p0", 0, partial=True) is first
        moved = dataclasses.replace(rank, control_endpoint="tcp://127.0.0.1:2999")
        client.register(moved)
        assert client._registration[0] is moved and client._registration[1] != packed
        second = client.lookup("p0", 0, partial=True)
        assert second is not first and second.ranks == (moved,)
        client.register(_rank(1))
        full = client.lookup("p0", 0)
        assert full.ready and full.ranks == (moved, _rank(1)) and client.lookup("p0", 0) is full


def test_a_lookup_or_registration_tells_its_caller_where_it_waits_and_paces_after_a_fresh_socket(
        bootstrap_server):
    """A caller that measures its holds of the interpreter lock (the link
    resolver) learns where the request waits for the reply (``waiting()``
    around exactly that wait), and is paced once the client opened a fresh
    socket (a few hundred microseconds) as well as between the reply's
    parts."""
    events: list[str] = []

    @contextlib.contextmanager
    def waiting():
        events.append("wait")
        yield
        events.append("replied")

    with BootstrapClient(bootstrap_server.address, timeout_s=5) as client:
        client.register(_rank(0))
        client._drop_socket()  # the next request opens a fresh one
        reply = client.lookup("p0", 0, partial=True, pace=lambda: events.append("pace"), waiting=waiting)
        assert reply.ranks == (_rank(0),)
        assert events[:3] == ["pace", "wait", "replied"] and events.count("wait") == 1, events
        assert events[3:].count("pace") >= 1 and set(events[3:]) == {"pace"}, events  # the reply's ranks decoded
        events.clear()
        client.lookup("p0", 0, partial=True, waiting=waiting)  # the socket is open: no pace
        assert events == ["wait", "replied"]
        events.clear()
        assert client.register(_rank(0), waiting=waiting).num_registered == 1  # re-registration's round too
        assert events == ["wait", "replied"]


@pytest.mark.parametrize("request_bytes", [SHORT_GET, CURL_GET], ids=["short", "curl"])
def test_an_http_request_to_the_zmq_port_fails_at_once_and_the_server_keeps_serving(bootstrap_server,
                                                                                      request_bytes):
    # A Mooncake router's GET /query sent to a standalone bootstrap server:
    # libzmq read the short one as a ZMTP 1.0 frame and waited forever.
    host, port = bootstrap_server.address.rsplit(":", 1)
    attempt = send_http(host, int(port), request_bytes, timeout_s=10.0)
    assert attempt.ended in ("reset", "closed"), attempt
    assert not attempt.received.startswith(b"HTTP/"), attempt
    with BootstrapClient(bootstrap_server.address, timeout_s=5) as client:
        assert client.register(_rank(0, tp_size=1, node="after-http")).num_registered == 1
        assert client.lookup("after-http", 0).ready
