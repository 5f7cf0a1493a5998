"""The zmq control channel: the only module of ``transfer`` that uses zmq.
It keeps the contract of :mod:`transfer.control.base`.

Each rank binds one ROUTER socket (its *control endpoint*) and reaches peers
through one DEALER per peer endpoint. Messages are one-way and self-describing
(they say who sent them), so replies are just messages the other way. One
thread receives, decodes with the codec and hands each message to the
handler; a malformed or unauthenticated message is counted and dropped, and
an exception in the handler is logged: the thread never dies of input. With
a shared secret every message is sealed and must verify (see
:mod:`bootstrap.codec`).
"""

from __future__ import annotations

import collections
import logging
import threading

import zmq

from bootstrap import codec
from transfer.control.base import Handler
from transfer.errors import AuthError, ClosedError, ProtocolError, TransferError

log = logging.getLogger("kvferry.channel")

# How long messages queued to a peer whose socket is evicted (over max_peers) may still take to leave.
_EVICT_LINGER_MS = 2000


class ZmqChannel:
    """``send`` is thread-safe and never blocks; ``close`` stops the receiver."""

    def __init__(self, host: str, handler: Handler, *, port: int = 0, send_queue_msgs: int = 10000,
                 secret: str | bytes | None = None, max_peers: int = 1024) -> None:
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES)
        try:
            if port:
                self._router.bind(f"tcp://{host}:{port}")
            else:
                port = self._router.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._router.close()
            self._ctx.term()
            raise OSError(f"control channel cannot bind tcp://{host}:{port}: {exc}") from exc
        self.endpoint = f"tcp://{host}:{port}"
        self._handler = handler
        self._key = codec.secret_key(secret)
        self._send_queue_msgs = send_queue_msgs
        # Least recently used first; beyond ``max_peers`` the oldest socket is
        # closed (a flood of introductions cannot exhaust file descriptors).
        self._dealers: collections.OrderedDict[str, zmq.Socket] = collections.OrderedDict()
        self._max_peers = max_peers
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self.num_received = 0
        self.num_malformed = 0
        self.num_unauthenticated = 0
        self._thread = threading.Thread(target=self._run, name="kvferry-control", daemon=True)
        self._thread.start()

    def send(self, endpoint: str, msg) -> None:
        """Queue ``msg`` for ``endpoint``. Raises ClosedError after close, and
        TransferError when the peer's queue is full."""
        payload = codec.encode(msg, self._key)
        with self._send_lock:
            if self._closed.is_set():
                raise ClosedError("control channel is closed")
            sock = self._dealers.get(endpoint)
            if sock is not None:
                self._dealers.move_to_end(endpoint)
            else:
                if len(self._dealers) >= self._max_peers:
                    # What is still queued to the evicted peer gets a while to leave (a live
                    # peer's messages are not dropped for being the least recently used).
                    self._dealers.popitem(last=False)[1].close(_EVICT_LINGER_MS)
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, self._send_queue_msgs)
                sock.connect(endpoint)
                self._dealers[endpoint] = sock
            try:
                sock.send(payload, zmq.NOBLOCK)
            except zmq.Again:
                raise TransferError(f"control queue to {endpoint} is full ({self._send_queue_msgs} messages)",
                                    peer=endpoint) from None

    def forget(self, endpoint: str) -> None:
        """Drop the socket to a peer taken for dead (and its queued messages);
        a later ``send`` reconnects."""
        with self._send_lock:
            sock = self._dealers.pop(endpoint, None)
            if sock is not None:
                sock.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                if not poller.poll(50):
                    continue
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if not self._closed.is_set():
                    log.error("control: receive failed: %s", exc)
                continue
            self.num_received += 1
            try:
                if len(frames) != 2:
                    raise ProtocolError(f"expected 1 payload frame, got {len(frames) - 1}")
                origin = _origin(frames[1])
                msg = codec.decode(frames[1].bytes, self._key)
            except AuthError as exc:
                self.num_unauthenticated += 1
                _log_drop(self.num_unauthenticated, "control %s: dropped an unauthenticated message (%d so far): %s",
                          self.endpoint, self.num_unauthenticated, exc)
                continue
            except ProtocolError as exc:
                self.num_malformed += 1
                _log_drop(self.num_malformed, "control %s: dropped a malformed message (%d so far): %s",
                          self.endpoint, self.num_malformed, exc)
                continue
            try:
                self._handler(msg, origin)
            except Exception:
                log.exception("control %s: handling %s failed; the channel goes on", self.endpoint, msg.KIND)
        self._router.close(0)

    def close(self, timeout_s: float = 2.0, linger_s: float = 0.1) -> None:
        """Stop receiving; messages still queued to peers get ``linger_s`` to
        leave (a failure notice sent just before close reaches its peer)."""
        with self._send_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            for sock in self._dealers.values():
                sock.close(int(linger_s * 1000))
            self._dealers.clear()
        self._thread.join(timeout_s)
        self._ctx.term()


def _origin(frame: zmq.Frame) -> str:
    """The TCP peer address of the connection ``frame`` came in on ("" if
    zmq cannot tell)."""
    try:
        return frame.get("Peer-Address") or ""
    except zmq.ZMQError:
        return ""


def _log_drop(count: int, fmt: str, *args) -> None:
    """A dropped message: WARNING for the 1st, 2nd, 4th, 8th... of its kind,
    DEBUG otherwise (a flood must not flood the log)."""
    log.log(logging.WARNING if count & (count - 1) == 0 else logging.DEBUG, fmt, *args)


def zmq_channel(host: str, handler: Handler, secret: str | None) -> ZmqChannel:
    """The :data:`~transfer.control.base.ChannelFactory` of zmq channels."""
    return ZmqChannel(host, handler, secret=secret)
