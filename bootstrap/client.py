"""Client of the bootstrap server: one request, one reply, always bounded."""

from __future__ import annotations

import threading

import zmq

from bootstrap import codec
from bootstrap.errors import AuthError, BootstrapError, BootstrapUnavailable, ProtocolError
from bootstrap.messages import ErrorReply, Lookup, LookupReply, Ping, Pong, RankInfo, Register, Registered


class BootstrapClient:
    """Talks to one bootstrap server at ``address`` (``host:port``).

    Every call blocks for at most ``timeout_s`` and then raises
    :class:`BootstrapUnavailable`; an error reply raises
    :class:`BootstrapError`, a refused or unauthenticated exchange
    :class:`AuthError`. With ``secret``, requests are sealed and replies must
    be (see :mod:`bootstrap.codec`). Thread-safe (calls are serialized).
    """

    def __init__(self, address: str, *, timeout_s: float = 5.0, secret: str | bytes | None = None) -> None:
        if ":" not in address:
            raise ValueError(f"bootstrap address must be host:port, got {address!r}")
        self.address = address
        self.timeout_s = timeout_s
        self._key = codec.secret_key(secret)
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.REQ_RELAXED, 1)
            sock.setsockopt(zmq.REQ_CORRELATE, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES)
            timeout_ms = max(1, int(self.timeout_s * 1000))
            sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
            sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            sock.connect(f"tcp://{self.address}")
            self._sock = sock
        return self._sock

    def request(self, msg):
        """Send ``msg`` and return the decoded reply (never an ErrorReply)."""
        payload = codec.encode(msg, self._key)
        with self._lock:
            sock = self._socket()
            try:
                sock.send(payload)
                data = sock.recv()
            except zmq.Again:
                # Drop the socket: a fresh one cannot get this request's late reply.
                sock.close(0)
                self._sock = None
                raise BootstrapUnavailable(
                    f"bootstrap server {self.address} did not answer {msg.KIND!r} within {self.timeout_s:g} s"
                ) from None
            except zmq.ZMQError as exc:
                sock.close(0)
                self._sock = None
                raise BootstrapUnavailable(f"bootstrap server {self.address}: {exc}") from exc
        try:
            reply = codec.decode(data, self._key)
        except AuthError as exc:
            refusal = self._refusal(data)
            raise AuthError(f"bootstrap server {self.address}: {refusal or exc}") from None
        if isinstance(reply, ErrorReply):
            if reply.code == "auth":
                raise AuthError(f"bootstrap server {self.address}: {reply.message}")
            raise BootstrapError(f"bootstrap server {self.address}: {reply.message}", code=reply.code)
        return reply

    @staticmethod
    def _refusal(data: bytes) -> str | None:
        """The server's bare 'auth' error reply, if ``data`` is one."""
        try:
            reply = codec.decode(data)
        except ProtocolError:
            return None
        return reply.message if isinstance(reply, ErrorReply) and reply.code == "auth" else None

    def register(self, rank: RankInfo) -> Registered:
        return self._expect(self.request(Register(rank=rank)), Registered)

    def lookup(self, node_id: str, dp_rank: int) -> LookupReply:
        return self._expect(self.request(Lookup(node_id=node_id, dp_rank=dp_rank)), LookupReply)

    def ping(self) -> Pong:
        return self._expect(self.request(Ping()), Pong)

    def _expect(self, reply, cls):
        if not isinstance(reply, cls):
            raise ProtocolError(f"bootstrap server {self.address} answered {reply.KIND!r}, expected {cls.KIND!r}")
        return reply

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None

    def __enter__(self) -> "BootstrapClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
