"""A decode rank's first contact with a prefill rank keeps its slow parts
off the rank's lock (issue 40: no periodic task holds what ``poll()``
needs): the resolver packs the hello (every buffer of the rank's pools) and
opens the new peer's control socket before it takes the lock, and sends
under the lock only a hello still current: one packed before the rank's
registered memory changed is packed again."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np

from bootstrap import codec
from transfer.config import Role
from transfer.control.base import Packed
from transfer.control.loopback import LoopbackChannel
from transfer.messages import PeerHello
from transfer.rooms.handshakes import Handshakes
from transfer.state import KVPoll

from ._fixtures import make_rank
from ._rooms import assert_landed, random_pages, run_room


def test_the_resolver_packs_the_hello_and_opens_the_peer_off_the_ranks_lock(cluster, monkeypatch):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    lock = decode.mgr._lock
    seen: dict[str, list[bool]] = {"pack": [], "connect": []}
    real_of, real_connect = Packed.of.__func__, LoopbackChannel.connect

    def of(cls, msg):
        if isinstance(msg, PeerHello):
            seen["pack"].append(lock._is_owned())  # this thread holds the rank's lock
        return real_of(cls, msg)

    def connect(self, endpoint, between=None):
        if self is decode.mgr.channel:
            seen["connect"].append(lock._is_owned())
            assert between is not None  # the resolver paces between the socket's parts
            between()  # gives the interpreter lock up, never takes the rank's
            seen["connect"].append(lock._is_owned())
        return real_connect(self, endpoint, between)

    monkeypatch.setattr(Packed, "of", classmethod(of))
    monkeypatch.setattr(LoopbackChannel, "connect", connect)
    rng = np.random.default_rng(3)
    src = random_pages(rng, 4)
    dst = random_pages(rng, 4)
    _, receiver = run_room(prefill, decode, 11, src, dst)
    assert receiver.poll() is KVPoll.Success
    assert_landed(prefill, decode, src, dst)
    assert seen["pack"] == [False], seen  # packed once, off the lock
    assert seen["connect"] and not any(seen["connect"]), seen
    # a second room on the same link packs and opens nothing more
    run_room(prefill, decode, 12, src, random_pages(rng, 4))
    assert seen["pack"] == [False]


class _Channel:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def send(self, endpoint: str, msg) -> None:
        self.sent.append((endpoint, msg.payload if isinstance(msg, Packed) else codec.pack(msg)))


class _Metadata:
    """A transport's peer metadata (NIXL's shape) that changes on demand."""

    def __init__(self) -> None:
        self.value = b"arena-1"

    def metadata(self) -> bytes:
        return self.value


def _handshakes() -> tuple[Handshakes, _Channel, _Metadata]:
    meta, channel = _Metadata(), _Channel()
    ctx = SimpleNamespace(rank=make_rank(node_id="decode"), config=SimpleNamespace(allow_missing_draft=False),
                          transport=SimpleNamespace(peer_metadata=meta), channel=channel, lock=threading.RLock(),
                          where="decode rank 0")
    return Handshakes(ctx), channel, meta


def _sent_meta(payload: bytes) -> bytes:
    return codec.decode(payload).transport_meta


def test_a_hello_is_packed_once_and_sent_as_packed():
    hs, channel, _ = _handshakes()
    first = hs.packed_hello()
    assert hs.packed_hello() is first  # nothing changed: not packed again
    hs.start("prefill-a", "tcp://a", first)
    hs.start("prefill-a", "tcp://a", first)  # one hello per session
    assert channel.sent == [("tcp://a", first[1].payload)]
    assert _sent_meta(channel.sent[0][1]) == b"arena-1"


def test_a_hello_packed_before_the_memory_changed_is_packed_again():
    hs, channel, meta = _handshakes()
    stale = hs.packed_hello()  # the resolver packs, off the lock ...
    meta.value = b"arena-2"  # ... the rank's memory changes and it announces (under the lock) ...
    hs.announce(lambda session: None)
    hs.start("prefill-a", "tcp://a", stale)  # ... and the resolver sends what it packed: not the stale one
    assert _sent_meta(channel.sent[-1][1]) == b"arena-2"
    # an announce after hellos went out sends the new memory to each, packed once
    hs.start("prefill-b", "tcp://b", hs.packed_hello())
    assert _sent_meta(channel.sent[-1][1]) == b"arena-2"
    meta.value = b"arena-4"
    hs.announce({"prefill-a": "tcp://a", "prefill-b": "tcp://b"}.get)
    assert [(ep, _sent_meta(p)) for ep, p in channel.sent[-2:]] == [("tcp://a", b"arena-4"), ("tcp://b", b"arena-4")]
    assert channel.sent[-1][1] is channel.sent[-2][1]
