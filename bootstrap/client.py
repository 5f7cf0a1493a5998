"""Client of the bootstrap server: one request, one reply, always bounded."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import zmq

from bootstrap import codec
from bootstrap.errors import (AuthError, BootstrapError, BootstrapRefused, BootstrapUnavailable, ProtocolError,
                              UnknownNodeError)
from bootstrap.messages import (MAX_KNOWN_NODES, ErrorReply, Lookup, LookupReply, Ping, Pong, RankInfo, Register,
                                Registered, Unregister, Unregistered)
from bootstrap.status import Status, StatusReply

#: How long a request waits for its reply before it checks, with a plain TCP
#: connect, whether anything listens at the server's address at all.
PROBE_AFTER_S = 0.1
#: The connect timeout of that check.
PROBE_TIMEOUT_S = 0.5


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); ValueError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bootstrap address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def refuses_connections(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when a TCP connect to ``address`` is refused (nothing listens
    there). False when it connects, or fails otherwise within ``timeout_s``
    (a slow or filtered network tells nothing)."""
    try:
        with socket.create_connection(split_address(address), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class BootstrapClient:
    """Talks to one bootstrap server at ``address`` (``host:port``).

    Every call blocks for at most ``timeout_s`` (or the call's own timeout)
    and then raises :class:`BootstrapUnavailable`. If no reply came within
    :data:`PROBE_AFTER_S`, one TCP connect checks the address: when it is
    refused, :class:`BootstrapRefused` (a ``BootstrapUnavailable``) is raised
    at once, not at the timeout. An error reply raises
    :class:`BootstrapError`, a refused or unauthenticated exchange
    :class:`AuthError`. With ``secret``, requests are sealed and replies must
    be (see :mod:`bootstrap.codec`). Thread-safe (calls are serialized).

    Periodic callers (a prefill rank re-registering, a decode rank looking a
    node up again) send and get the same bytes again and again: the last
    registration is packed once per :class:`RankInfo`, and a reply equal to
    the last one is not decoded again (messages are frozen), so a steady
    round costs its thread tens of microseconds of the interpreter lock, not
    a decode of every rank's descriptors.
    """

    def __init__(self, address: str, *, timeout_s: float = 5.0, secret: str | bytes | None = None) -> None:
        split_address(address)
        self.address = address
        self.timeout_s = timeout_s
        self._key = codec.secret_key(secret)
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None
        self._registration: tuple[RankInfo, bytes] | None = None  # the last rank registered, packed
        self._last_reply: tuple[bytes, object] | None = None  # the last reply's payload, decoded

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.REQ_RELAXED, 1)
            sock.setsockopt(zmq.REQ_CORRELATE, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout_s * 1000)))
            sock.connect(f"tcp://{self.address}")
            self._sock = sock
        return self._sock

    def _drop_socket(self) -> None:
        # A fresh socket cannot get the abandoned request's late reply.
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def request(self, msg, *, timeout_s: float | None = None, pace: Callable[[], None] | None = None,
                waiting: Callable[[], AbstractContextManager] | None = None):
        """Send ``msg`` and return the decoded reply (never an ErrorReply);
        ``pace`` as :func:`bootstrap.codec.decode`'s, also called once the
        socket is open; the reply is waited for, with the interpreter lock
        released, inside ``waiting()`` (a caller that measures its holds of
        the lock ends one there and begins the next on the reply)."""
        return self._request(codec.pack(msg), msg, timeout_s, pace, waiting)

    def _request(self, packed: bytes, msg, timeout_s: float | None, pace: Callable[[], None] | None = None,
                 waiting: Callable[[], AbstractContextManager] | None = None):
        payload = codec.seal(packed, self._key)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            fresh = self._sock is None
            sock = self._socket()
            if fresh and pace is not None:
                pace()
            try:
                sock.send(payload)
                with (waiting or contextlib.nullcontext)():
                    data = self._receive(sock, msg, timeout_s)
            except zmq.ZMQError as exc:
                self._drop_socket()
                raise BootstrapUnavailable(f"bootstrap server {self.address}: {exc}") from exc
            except BootstrapUnavailable:
                self._drop_socket()
                raise
        return self._decode(data, pace)

    def _receive(self, sock: zmq.Socket, msg, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        probed = False
        while True:
            left = deadline - time.monotonic()
            wait = left if probed else min(left, PROBE_AFTER_S)
            if wait > 0 and sock.poll(max(1, int(wait * 1000)), zmq.POLLIN):
                return sock.recv()
            if time.monotonic() >= deadline:
                raise BootstrapUnavailable(
                    f"bootstrap server {self.address} did not answer {msg.KIND!r} within {timeout_s:g} s")
            if not probed:
                probed = True
                if refuses_connections(self.address, min(PROBE_TIMEOUT_S, max(0.05, left))):
                    raise BootstrapRefused(f"bootstrap server {self.address} refused the connection "
                                           f"(nothing listens there); {msg.KIND!r} not sent")

    def _decode(self, data: bytes, pace: Callable[[], None] | None = None):
        try:
            payload = codec.unseal(data, self._key)
            last = self._last_reply
            if last is not None and last[0] == payload:
                return last[1]
            reply = codec.decode(payload, pace=pace)
        except AuthError as exc:
            refusal = self._refusal(data)
            raise AuthError(f"bootstrap server {self.address}: {refusal or exc}") from None
        if isinstance(reply, ErrorReply):
            if reply.code == "auth":
                raise AuthError(f"bootstrap server {self.address}: {reply.message}")
            raise BootstrapError(f"bootstrap server {self.address}: {reply.message}", code=reply.code)
        self._last_reply = (payload, reply)
        return reply

    @staticmethod
    def _refusal(data: bytes) -> str | None:
        """The server's bare 'auth' error reply, if ``data`` is one."""
        try:
            reply = codec.decode(data)
        except ProtocolError:
            return None
        return reply.message if isinstance(reply, ErrorReply) and reply.code == "auth" else None

    def register(self, rank: RankInfo, *, waiting: Callable[[], AbstractContextManager] | None = None) -> Registered:
        """Register (or renew) ``rank``; ``waiting`` as :meth:`request`'s."""
        msg, last = Register(rank=rank), self._registration
        if last is None or last[0] is not rank:
            last = self._registration = (rank, codec.pack(msg))
        return self._expect(self._request(last[1], msg, None, None, waiting), Registered)

    def unregister(self, rank: RankInfo, *, timeout_s: float = 0.5) -> Unregistered:
        """Remove ``rank``'s entry now (only if the server holds it with
        ``rank.session``). For a closing prefill rank: a short timeout, and
        the caller may ignore :class:`BootstrapUnavailable` (the entry then
        expires at the server's rank TTL)."""
        msg = Unregister(node_id=rank.node_id, dp_rank=rank.dp_rank, tp_rank=rank.tp_rank, session=rank.session)
        return self._expect(self.request(msg, timeout_s=timeout_s), Unregistered)

    def lookup(self, node_id: str, dp_rank: int, *, strict: bool = False, partial: bool = False,
               pace: Callable[[], None] | None = None,
               waiting: Callable[[], AbstractContextManager] | None = None) -> LookupReply:
        """The DP group's ranks (``ready``) or the progress (not ready; with
        ``partial``, the ranks registered so far and those that left). An
        unknown node (see :class:`LookupReply`) is a not-ready reply with
        ``unknown_node`` set, or, with ``strict``, raises
        :class:`UnknownNodeError` naming the known nodes. ``pace()`` is called
        between the reply's parts as it is decoded (a background caller gives
        the interpreter lock up there); ``waiting`` as :meth:`request`'s."""
        reply = self._expect(self.request(Lookup(node_id=node_id, dp_rank=dp_rank, partial=partial), pace=pace,
                                          waiting=waiting), LookupReply)
        if strict and reply.unknown_node:
            known = ", ".join(map(repr, reply.known_nodes)) or "none"
            if len(reply.known_nodes) == MAX_KNOWN_NODES:
                known += ", ... (the first few only)"
            raise UnknownNodeError(f"bootstrap server {self.address} knows no prefill node {node_id!r} "
                                   f"(known nodes: {known})", node_id=node_id, known_nodes=reply.known_nodes)
        return reply

    def status(self) -> StatusReply:
        return self._expect(self.request(Status()), StatusReply)

    def ping(self) -> Pong:
        return self._expect(self.request(Ping()), Pong)

    def _expect(self, reply, cls):
        if not isinstance(reply, cls):
            raise ProtocolError(f"bootstrap server {self.address} answered {reply.KIND!r}, expected {cls.KIND!r}")
        return reply

    def close(self) -> None:
        with self._lock:
            self._drop_socket()

    def __enter__(self) -> BootstrapClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
