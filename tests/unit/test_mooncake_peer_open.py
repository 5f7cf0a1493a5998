"""Opening the way to a peer that does not answer, with the real Mooncake
engine (TCP on loopback) and listeners that accept and never speak.

P2P (``mooncake_metadata="p2p"``): the engine opens a peer's segment by a
handshake with the peer engine's listener, inside its write call and under
its one mutex. That call runs on the opener thread, never on the worker's
or a caller's: ``pump()`` returns at once, a waiting write says what it
waits for, and the peer's plans fail with a HandshakeError naming the peer
and the handshake at ``handshake_timeout_s``.

Relay (the default): the segment comes from kvferry's handshake, so a
silent handshake listener is never contacted; a peer whose *data* port is
silent stalls its own probe write, and the writes to another peer go on
meanwhile.
"""

import json
import re
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

from transfer.config import EngineConfig  # noqa: E402
from transfer.errors import HandshakeError  # noqa: E402
from transfer.plan import TransferPlan  # noqa: E402
from transfer.transport.mooncake.peer_meta import MooncakePeerMeta, decode_peer_meta  # noqa: E402
from transfer.transport.mooncake.transport import MooncakeTransport  # noqa: E402


class SilentListener:
    """Accepts connections and never answers (a held handshake port)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for conn in self.held:
            conn.close()
        self.sock.close()


class Done:
    def __init__(self) -> None:
        self.calls, self.event = [], threading.Event()

    def __call__(self, error) -> None:
        self.calls.append(error)
        self.event.set()

    def wait(self, timeout_s: float):
        assert self.event.wait(timeout_s), f"no callback within {timeout_s} s"
        return self.calls[0]


def _plan(src: np.ndarray, dst_addr: int, nbytes: int = 4096) -> TransferPlan:
    return TransferPlan(np.array([src.ctypes.data], dtype=np.uint64), np.array([dst_addr], dtype=np.uint64),
                        np.array([nbytes], dtype=np.uint64))


def _timed_pumps(transport, seconds: float) -> float:
    """Pump for ``seconds``; the longest single pump() call."""
    longest, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        transport.pump()
        longest = max(longest, time.perf_counter() - t0)
        time.sleep(0.001)
    return longest


def test_p2p_a_silent_handshake_listener_fails_the_peer_at_its_bound_and_never_blocks_a_caller():
    listener = SilentListener()
    peer = f"127.0.0.1:{listener.port}"
    transport = MooncakeTransport(EngineConfig(protocol="tcp", mooncake_metadata="p2p", handshake_timeout_s=1.5))
    src = np.zeros(4096, dtype=np.uint8)
    transport.register([(src.ctypes.data, src.nbytes)])
    try:
        done = Done()
        t0 = time.monotonic()
        job = transport.submit(peer, _plan(src, 1 << 20), done, None)
        deadline = time.monotonic() + 5
        while not listener.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.held, "the engine never connected to the peer's handshake port"
        # the engine call holds the opener, not the caller: it lasts until the handshake's bound (1.5 s),
        # so a pump that waited for it would return only once the peer failed; every pump returns while
        # the handshake still runs (the job still waits), each in a small part of the bound
        longest = _timed_pumps(transport, 0.5)
        what = transport.describe_job(job)
        assert longest < 0.15, f"a pump() took {longest * 1e3:.0f} ms while the engine's handshake call ran"
        assert re.search(rf"waiting for the way to {re.escape(peer)} to open \(handshake running for \d", what), what
        assert "last round ended" in what, what  # the worker is not stuck in the engine
        error = done.wait(5.0)
        took = time.monotonic() - t0
        assert isinstance(error, HandshakeError) and error.peer == peer
        assert f"the handshake with {peer} did not finish within 1.5 s" in str(error)
        assert "P2P handshake with its listener" in str(error) and "one connection at a time" in str(error)
        assert 1.4 < took < 3.0, took
        counts = transport.handshake_counts()
        assert counts["handshake_timeouts"] == 1 and counts["handshake_failures"] == 1 and counts["handshakes"] == 0
    finally:
        listener.close()
        transport.close()


def test_relay_never_contacts_a_held_handshake_listener():
    writer = MooncakeTransport(EngineConfig(protocol="tcp"))
    target = MooncakeTransport(EngineConfig(protocol="tcp"))
    src = np.random.default_rng(5).integers(0, 256, 4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    writer.register([(src.ctypes.data, src.nbytes)])
    target.register([(dst.ctypes.data, dst.nbytes)])
    idle = [socket.create_connection(("127.0.0.1", target.handshake_port)) for _ in range(3)]
    try:
        opened = Done()
        t0 = time.monotonic()
        writer.open_peer(target.session, target.metadata(), opened)
        assert opened.wait(3.0) is None
        done = Done()
        writer.submit(target.session, _plan(src, dst.ctypes.data), done, None)
        assert done.wait(3.0) is None and bytes(dst) == bytes(src)
        assert time.monotonic() - t0 < 1.0  # three idle connections ahead would have cost 15 s by P2P
    finally:
        for s in idle:
            s.close()
        writer.close()
        target.close()


def test_relay_a_silent_data_port_stalls_only_its_own_peer():
    handshake_s = 1.5
    writer = MooncakeTransport(EngineConfig(protocol="tcp", handshake_timeout_s=handshake_s))
    good = MooncakeTransport(EngineConfig(protocol="tcp"))
    src = np.random.default_rng(6).integers(0, 256, 64 << 10, dtype=np.uint8)
    dst = np.zeros(64 << 10, dtype=np.uint8)
    writer.register([(src.ctypes.data, src.nbytes)])
    good.register([(dst.ctypes.data, dst.nbytes)])
    listener = SilentListener()
    # A peer whose relayed descriptor names a data port that accepts and never answers.
    meta = decode_peer_meta(good.metadata())
    fake = f"127.0.0.1:kvferry-silent{listener.port}"
    entries = []
    for key, value in meta.entries:
        body = json.loads(value)
        if "tcp_data_port" in body:
            body["tcp_data_port"] = listener.port
        body = json.loads(json.dumps(body).replace(good.session, fake))
        entries.append((key.replace(good.session, fake), json.dumps(body)))
    blob = MooncakePeerMeta(mode="relay", probe_addr=meta.probe_addr, probe_bytes=meta.probe_bytes,
                            entries=tuple(entries)).encode()
    try:
        opened = Done()
        writer.open_peer(good.session, good.metadata(), opened)
        assert opened.wait(3.0) is None
        stalled = Done()
        writer.open_peer(fake, blob, stalled)
        deadline = time.monotonic() + 3
        while not listener.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.held, "the probe write never reached the silent data port"
        # Meanwhile the good peer's writes go on: each takes milliseconds, and one that waited behind the
        # stalled open would take its handshake bound (a fifth of it is the line between the two).
        for i in range(20):
            done = Done()
            t0 = time.monotonic()
            writer.submit(good.session, _plan(src, dst.ctypes.data, src.nbytes), done, None)
            assert done.wait(2.0) is None and time.monotonic() - t0 < handshake_s / 5
            assert not stalled.calls or i > 0
        assert bytes(dst) == bytes(src)
        error = stalled.wait(5.0)
        assert isinstance(error, HandshakeError) and error.peer == fake
        assert "probe write" in str(error) and "still pending" in str(error), error
    finally:
        listener.close()
        writer.close()
        good.close()


class Forwarder:
    """A TCP port that forwards each connection to ``upstream`` (a data port);
    ``cut()`` closes every connection it carries (the process behind died),
    and a later connection goes to whatever ``upstream`` is then."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self.sock.accept()
            except OSError:
                continue
            up = socket.create_connection(("127.0.0.1", self.upstream))
            self.conns += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self.conns = []

    def close(self) -> None:
        self._stop.set()
        self.cut()
        self.sock.close()


def _behind(target: MooncakeTransport, name: str, port: int) -> bytes:
    """``target``'s handshake blob, as if its segment were named ``name`` and
    its data port were ``port`` (a forwarder to it)."""
    meta = decode_peer_meta(target.metadata())
    entries = []
    for key, value in meta.entries:
        body = json.loads(value)
        if "tcp_data_port" in body:
            body["tcp_data_port"] = port
        entries.append((key.replace(target.session, name), json.dumps(body).replace(target.session, name)))
    return MooncakePeerMeta(mode="relay", probe_addr=meta.probe_addr, probe_bytes=meta.probe_bytes,
                            entries=tuple(entries)).encode()


def test_a_peer_on_the_dead_peer_s_data_port_is_opened_before_its_first_write():
    """Mooncake pools its data connections by the peer's address and port:
    a restarted peer that got its predecessor's data port back (Mooncake
    picks ports at random among 2,000) finds the dead process's connections
    pooled, each failing one write. The open's probe bursts go on until one
    lands whole, so the first room's writes land; the cost is Mooncake's
    fixed 1 s reconnect cool-down, counted. A forwarder stands for the port:
    its connections cut is the first peer dying."""
    writer = MooncakeTransport(EngineConfig(protocol="tcp"))
    first, second = MooncakeTransport(EngineConfig(protocol="tcp")), MooncakeTransport(EngineConfig(protocol="tcp"))
    src = np.random.default_rng(8).integers(0, 256, 1 << 20, dtype=np.uint8)
    dsts = [np.zeros(1 << 20, dtype=np.uint8) for _ in range(2)]
    writer.register([(src.ctypes.data, src.nbytes)])
    for t, dst in zip((first, second), dsts):
        t.register([(dst.ctypes.data, dst.nbytes)])
    port_of = {t: _data_port(t.metadata()) for t in (first, second)}
    forwarder = Forwarder(port_of[first])
    piece = src.nbytes // 16  # a room's write of several descriptors: over several pooled connections

    def room(name: str, dst: np.ndarray):
        plan = TransferPlan(np.array([src.ctypes.data + i * piece for i in range(16)], dtype=np.uint64),
                            np.array([dst.ctypes.data + i * piece for i in range(16)], dtype=np.uint64),
                            np.full(16, piece, dtype=np.uint64))
        done = Done()
        writer.submit(name, plan, done, None)
        return done.wait(5.0)

    try:
        for name, target, dst, stale in (("127.0.0.1:kvferry-dead", first, dsts[0], 0),
                                         ("127.0.0.1:kvferry-restarted", second, dsts[1], 1)):
            opened = Done()
            t0 = time.monotonic()
            writer.open_peer(name, _behind(target, name, forwarder.port), opened)
            assert opened.wait(5.0) is None
            open_s = time.monotonic() - t0
            assert room(name, dst) is None and bytes(dst) == bytes(src), name
            counts = writer.handshake_counts()
            assert (counts["handshake_stale_writes"] > 0) == bool(stale), (name, counts)
            assert open_s < (0.5 if not stale else 2.0), (name, open_s)
            forwarder.cut()  # the first peer dies: the writer's pooled connections to the port are dead
            forwarder.upstream = port_of[second]  # and its successor listens there
    finally:
        forwarder.close()
        for t in (writer, first, second):
            t.close()


def _data_port(blob: bytes) -> int:
    return next(json.loads(v)["tcp_data_port"] for k, v in decode_peer_meta(blob).entries if "/ram/" in k)
