"""The bootstrap server: a ZMQ ROUTER answering Register, Lookup and Ping.

It serves REQ clients (frames ``[id, b"", payload]``) and DEALER clients
(``[id, payload]``). Whatever arrives, the serving loop answers it or drops
it and goes on: malformed input gets an :class:`ErrorReply` naming the
problem and is counted; no request can stop the server.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from bootstrap import codec
from bootstrap.errors import AuthError, ProtocolError
from bootstrap.messages import ErrorReply, Lookup, Ping, Pong, Register
from bootstrap.registry import Registry, RegistryConflict

log = logging.getLogger("kvferry.bootstrap")

DEFAULT_PORT = 8998


class BootstrapServer:
    """Owns the ROUTER socket and the registry.

    ``serve_forever()`` blocks until :meth:`close` is called (from another
    thread or a signal handler); ``start()`` runs it on a daemon thread.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, secret: str | bytes | None = None,
                 rank_ttl_s: float = 15.0) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        try:
            if port == 0:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise OSError(f"bootstrap server cannot bind tcp://{host}:{port}: {exc}") from exc
        self.host, self.port = host, port
        self.registry = Registry(ttl_s=rank_ttl_s)
        self._key = codec.secret_key(secret)
        self.num_requests = 0
        self.num_errors = 0
        self.num_unauthenticated = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "BootstrapServer":
        self._thread = threading.Thread(target=self.serve_forever, name="kvferry-bootstrap", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                log.error("bootstrap: receive failed: %s", exc)
                continue
            self._serve(frames)
        self._sock.close()
        self._ctx.term()

    def _serve(self, frames: list[bytes]) -> None:
        # REQ clients send [id, (correlation id,) b"", payload]: everything up
        # to the empty delimiter is echoed back. DEALER clients send [id, payload].
        self.num_requests += 1
        if len(frames) >= 3 and frames[-2] == b"":
            head, payload = frames[:-1], frames[-1]
        elif len(frames) == 2:
            head, payload = frames[:1], frames[1]
        else:
            self.num_errors += 1
            log.warning("bootstrap: dropped a request of %d frames", len(frames))
            if len(frames) > 2:
                reply = ErrorReply(code="protocol", message=f"expected 1 payload frame, got {len(frames) - 1}")
                self._send(frames[:1], reply)
            return
        reply = self._answer(payload)
        # A refused requester has no secret (or the wrong one): it could not
        # read a sealed error, so that one reply goes out bare.
        self._send(head, reply, seal=not (isinstance(reply, ErrorReply) and reply.code == "auth"))

    def _answer(self, payload: bytes):
        try:
            request = codec.decode(payload, self._key)
            if isinstance(request, Register):
                reply = self.registry.register(request.rank, time.monotonic())
                log.debug("bootstrap: registered %s dp %d tp %d/%d (%d of %d)",
                         request.rank.node_id, request.rank.dp_rank, request.rank.tp_rank,
                         request.rank.tp_size, reply.num_registered, reply.tp_size)
                return reply
            if isinstance(request, Lookup):
                return self.registry.lookup(request.node_id, request.dp_rank, time.monotonic())
            if isinstance(request, Ping):
                return Pong(num_nodes=self.registry.num_nodes, num_errors=self.num_errors)
            raise ProtocolError(f"the bootstrap server does not serve {request.KIND!r} messages")
        except AuthError as exc:
            self.num_errors += 1
            self.num_unauthenticated += 1
            log.warning("bootstrap: refused: %s", exc)
            return ErrorReply(code="auth", message=str(exc))
        except ProtocolError as exc:
            self.num_errors += 1
            log.warning("bootstrap: bad request: %s", exc)
            return ErrorReply(code="protocol", message=str(exc))
        except RegistryConflict as exc:
            self.num_errors += 1
            return ErrorReply(code="conflict", message=str(exc))
        except Exception as exc:  # the loop must survive anything a request triggers
            self.num_errors += 1
            log.exception("bootstrap: internal error")
            return ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")

    def _send(self, head: list[bytes], reply, *, seal: bool = True) -> None:
        try:
            self._sock.send_multipart([*head, codec.encode(reply, self._key if seal else None)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("bootstrap: reply dropped: %s", exc)

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
