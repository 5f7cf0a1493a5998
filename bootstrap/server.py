"""The bootstrap server: a ZMQ ROUTER answering Register, Unregister, Lookup,
Status and Ping.

It serves REQ clients (frames ``[id, b"", payload]``) and DEALER clients
(``[id, payload]``, or ``[id, request id, b"", payload]`` to correlate).
Whatever arrives, the serving loop answers it or drops it and goes on:
malformed input gets an :class:`ErrorReply` naming the problem and is
counted; no request can stop the server.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq

from bootstrap import codec
from bootstrap.errors import AuthError, ProtocolError
from bootstrap.listen import refuse_unversioned
from bootstrap.messages import ErrorReply, Lookup, Ping, Pong, Register, Unregister
from bootstrap.metrics import NoMetrics, PrometheusMetrics, require_prometheus
from bootstrap.protect import check_protected
from bootstrap.registry import Registry, RegistryConflict
from bootstrap.status import MAX_STATUS_RANKS, RankStatus, Status, StatusReply

log = logging.getLogger("kvferry.bootstrap")

#: Decoded requests are kept by their (authenticated) payload bytes, up to
#: this many of at most _CACHE_BYTES each: a rank re-registers the same bytes
#: every 2 s, and decoding a Register checks every buffer of every layer.
_CACHE_ENTRIES = 8192
_CACHE_BYTES = 64 << 10

DEFAULT_PORT = 8998


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """One bootstrap server.

    ``secret``: authenticates every message (None: off). A ``host`` that is
    not a loopback address needs a secret or ``insecure=True`` (see
    :mod:`bootstrap.protect`). ``rank_ttl_s``: drop a rank not re-registered
    for that long (0: never). ``node_grace_s``: for that long after start a
    lookup of a node nobody registered is "not ready" (the ranks of a
    restarted server re-register within it: they do every 2 s); after it,
    "unknown node". ``metrics_port``: serve Prometheus ``/metrics`` there, on
    ``host`` (needs ``prometheus-client``; None: off, 0: any free port).
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    secret: str | bytes | None = None
    rank_ttl_s: float = 15.0
    node_grace_s: float = 4.0
    insecure: bool = False
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port must be in [0, 65536), got {self.port}")
        if self.rank_ttl_s < 0 or self.node_grace_s < 0:
            raise ValueError("ServerConfig.rank_ttl_s and node_grace_s must be >= 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"ServerConfig.metrics_port must be in [0, 65536), got {self.metrics_port}")
        check_protected(self.host, has_secret=bool(self.secret), insecure=self.insecure,
                        what="the bootstrap server", how_insecure="--insecure (KVFERRY_INSECURE=1)")


def _log_drop(count: int, fmt: str, *args) -> None:
    """A refused request: WARNING for the 1st, 2nd, 4th, 8th... (``count``),
    DEBUG otherwise, so a flood of bad requests does not flood the log."""
    log.log(logging.WARNING if count & (count - 1) == 0 else logging.DEBUG, fmt, *args)


class BootstrapServer:
    """Owns the ROUTER socket and the registry.

    ``BootstrapServer(ServerConfig(...))``, or ``BootstrapServer(host, port,
    **fields of ServerConfig)``. Raises ``InsecureBindError`` (protected
    mode), ``OSError`` when the address cannot be bound. ``serve_forever()``
    blocks until :meth:`close` is called (from another thread or a signal
    handler); ``start()`` runs it on a daemon thread.
    """

    def __init__(self, host: str | ServerConfig = "127.0.0.1", port: int = DEFAULT_PORT, **options) -> None:
        config = host if isinstance(host, ServerConfig) else ServerConfig(host=host, port=port, **options)
        self.config = config
        if config.metrics_port is not None:
            require_prometheus()  # before anything is bound
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, codec.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        refuse_unversioned(self._sock)  # an HTTP request here fails at once
        try:
            if config.port == 0:
                port = self._sock.bind_to_random_port(f"tcp://{config.host}")
            else:
                port = config.port
                self._sock.bind(f"tcp://{config.host}:{port}")
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise OSError(f"bootstrap server cannot bind tcp://{config.host}:{config.port}: {exc}") from exc
        self.host, self.port = config.host, port
        try:
            self.metrics = NoMetrics() if config.metrics_port is None else PrometheusMetrics(config.host,
                                                                                             config.metrics_port)
        except OSError as exc:
            self._sock.close()
            self._ctx.term()
            raise OSError(f"bootstrap server cannot serve metrics on {config.host}:{config.metrics_port}: "
                          f"{exc}") from exc
        self.started_at = time.monotonic()
        self.registry = Registry(ttl_s=config.rank_ttl_s, node_grace_s=config.node_grace_s,
                                 started_at=self.started_at)
        self._key = codec.secret_key(config.secret)
        self.num_requests = 0
        self.num_errors = 0
        self.num_unauthenticated = 0
        self._stop = threading.Event()
        self._serving = False
        self._thread: threading.Thread | None = None
        self._decoded: dict[bytes, object] = {}
        # Encoded lookup replies that list ranks, by (node, dp, partial): (version
        # of the node they are valid for, the lookup's result, payload).
        self._replies: dict[tuple[str, int, bool], tuple[int, str, bytes]] = {}
        self._handlers = {Register: self._register, Unregister: self._unregister, Lookup: self._lookup,
                          Status: self._status, Ping: self._ping}

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> BootstrapServer:
        self._thread = threading.Thread(target=self.serve_forever, name="kvferry-bootstrap", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._serving = True
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
        self.metrics.close()

    def _serve(self, frames: list[bytes]) -> None:
        # REQ clients send [id, (correlation id,) b"", payload]: everything up
        # to the empty delimiter is echoed back. DEALER clients send [id, payload].
        started = time.perf_counter()
        self.num_requests += 1
        if len(frames) >= 3 and frames[-2] == b"":
            head, payload = frames[:-1], frames[-1]
        elif len(frames) == 2:
            head, payload = frames[:1], frames[1]
        else:
            self.num_errors += 1
            self.metrics.on_dropped("malformed")
            _log_drop(self.num_errors, "bootstrap: dropped a request of %d frames (%d errors so far)", len(frames),
                      self.num_errors)
            if len(frames) > 2:
                reply = ErrorReply(code="protocol", message=f"expected 1 payload frame, got {len(frames) - 1}")
                self._send(frames[:1], reply)
            return
        kind, reply = self._answer(payload)
        # A refused requester has no secret (or the wrong one): it could not
        # read a sealed error, so that one reply goes out bare.
        if isinstance(reply, bytes):  # encoded already
            data = codec.seal(reply, self._key)
        else:
            data = codec.encode(reply, None if isinstance(reply, ErrorReply) and reply.code == "auth" else self._key)
        # Counted before the reply leaves: a client that has its reply finds
        # the request in the metrics.
        self.metrics.on_request(kind, time.perf_counter() - started, self.registry.num_ranks)
        try:
            self._sock.send_multipart([*head, data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("bootstrap: reply dropped: %s", exc)

    def _answer(self, payload: bytes) -> tuple[str, object]:
        """(the request's kind, or "invalid"; the reply)."""
        kind = "invalid"
        try:
            request = self._decode(payload)
            handler = self._handlers.get(type(request))
            if handler is None:
                raise ProtocolError(f"the bootstrap server does not serve {request.KIND!r} messages")
            kind = request.KIND
            return kind, handler(request, time.monotonic())
        except AuthError as exc:
            self.num_errors += 1
            self.num_unauthenticated += 1
            self.metrics.on_dropped("unauthenticated")
            _log_drop(self.num_unauthenticated, "bootstrap: refused (%d so far): %s", self.num_unauthenticated, exc)
            return kind, ErrorReply(code="auth", message=str(exc))
        except ProtocolError as exc:
            self.num_errors += 1
            self.metrics.on_dropped("malformed")
            _log_drop(self.num_errors, "bootstrap: bad request (%d errors so far): %s", self.num_errors, exc)
            return kind, ErrorReply(code="protocol", message=str(exc))
        except RegistryConflict as exc:
            self.num_errors += 1
            return kind, ErrorReply(code="conflict", message=str(exc))
        except Exception as exc:  # the loop must survive anything a request triggers
            self.num_errors += 1
            log.exception("bootstrap: internal error")
            return kind, ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")

    def _decode(self, frame: bytes):
        """The request in ``frame``: authenticated first, then decoded, or
        taken from the cache of recently decoded payloads."""
        payload = codec.unseal(frame, self._key)
        request = self._decoded.get(payload)
        if request is None:
            request = codec.decode(payload)
            if len(payload) <= _CACHE_BYTES:
                if len(self._decoded) >= _CACHE_ENTRIES:
                    del self._decoded[next(iter(self._decoded))]  # the oldest
                self._decoded[payload] = request
        return request

    # --- one handler per request kind: (request, monotonic now) -> reply ----------

    def _register(self, request: Register, now: float):
        reply = self.registry.register(request.rank, now)
        self.metrics.on_registration()
        log.debug("bootstrap: registered %s dp %d tp %d/%d (%d of %d)", request.rank.node_id,
                  request.rank.dp_rank, request.rank.tp_rank, request.rank.tp_size, reply.num_registered,
                  reply.tp_size)
        return reply

    def _unregister(self, request: Unregister, now: float):
        reply = self.registry.unregister(request.node_id, request.dp_rank, request.tp_rank, request.session)
        if reply.removed:
            self.metrics.on_unregistration()
        log.info("bootstrap: %s %s dp %d tp %d (session %s)", "unregistered" if reply.removed else
                 "ignored the unregistration of", request.node_id, request.dp_rank, request.tp_rank, request.session)
        return reply

    def _lookup(self, request: Lookup, now: float):
        """A reply that lists ranks (ready: 8 ranks of 61 layers, ~27 KB,
        ~1.5 ms to encode; or partial) is encoded once per version of its
        node and sent as bytes after that."""
        key = (request.node_id, request.dp_rank, request.partial)
        self.registry.expire_if_due(now)
        cached = self._replies.get(key)
        if cached is not None and cached[0] == self.registry.node_version(request.node_id):
            self.metrics.on_lookup(cached[1])
            return cached[2]
        try:
            reply = self.registry.lookup(request.node_id, request.dp_rank, now, partial=request.partial)
        except RegistryConflict:
            self.metrics.on_lookup("refused")
            raise
        result = "ready" if reply.ready else "unknown_node" if reply.unknown_node else "not_ready"
        self.metrics.on_lookup(result)
        if not reply.ranks:  # nothing costly to encode (and an unknown node's reply changes with the clock)
            return reply
        if len(self._replies) >= _CACHE_ENTRIES:
            self._replies.clear()
        payload = codec.encode(reply)
        self._replies[key] = (self.registry.node_version(request.node_id), result, payload)
        return payload

    def _status(self, request: Status, now: float):
        entries = self.registry.entries(now)
        ranks = tuple(RankStatus.of(r, age_s=round(age, 3)) for r, age in entries[:MAX_STATUS_RANKS])
        return StatusReply(uptime_s=round(now - self.started_at, 3), rank_ttl_s=self.config.rank_ttl_s,
                           node_grace_s=self.config.node_grace_s, num_requests=self.num_requests,
                           num_errors=self.num_errors, num_unauthenticated=self.num_unauthenticated,
                           num_expired=self.registry.num_expired, ranks=ranks,
                           num_omitted=max(0, len(entries) - MAX_STATUS_RANKS))

    def _ping(self, request: Ping, now: float):
        return Pong(num_nodes=self.registry.num_nodes, num_errors=self.num_errors)

    def _send(self, head: list[bytes], reply) -> None:
        try:
            self._sock.send_multipart([*head, codec.encode(reply, self._key)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("bootstrap: reply dropped: %s", exc)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop serving; the serving loop closes the socket and the metrics
        server. Safe to call from a signal handler while serve_forever() runs."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        elif not self._serving:  # never served: nothing else will close them
            self._serving = True
            self._sock.close()
            self._ctx.term()
            self.metrics.close()
