"""The HTTP side of a vLLM prefill's bootstrap port, for vLLM's Mooncake routers.

vLLM's MooncakeConnector routers (vllm-router ``--kv-connector mooncake``,
vLLM's own ``mooncake_connector_proxy``) ask each prefill instance's
bootstrap port over HTTP for its engine (``GET /query``, port 8998 unless
told otherwise) before they post a request to prefill and decode at once.
kvferry's bootstrap server speaks ZMQ; a prefill that serves the bootstrap
(``kvferry_serve_bootstrap``) answers HTTP on that port instead and runs
kvferry's ZMQ server beside it (``ConnectorConfig.kvferry_addr``), as
SGLang's side does behind SGLang's bootstrap port. Routes:

- ``GET /query``: :func:`~transfer.adapters.vllm.params.query_reply`, the
  body vLLM's Mooncake bootstrap server gives;
- ``GET /kvferry``: ``{"port": <kvferry's ZMQ bootstrap port>}`` (a
  decode handed this port's address finds kvferry's there);
- ``GET /health``: 200.

Anything else is a 404; a client that stalls mid-request is dropped after
a few seconds.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("kvferry.vllm")

_TIMEOUT_S = 5.0  # a client that stalls mid-request is dropped after this


class QueryServer:
    """Serves ``body`` (JSON) at ``GET /query`` and ``{"port": kvferry_port}``
    at ``GET /kvferry`` on ``host:port`` from a daemon thread."""

    def __init__(self, host: str, port: int, body: dict, kvferry_port: int) -> None:
        routes = {"/query": json.dumps(body).encode(), "/kvferry": json.dumps({"port": kvferry_port}).encode(),
                  "/health": b"{}"}

        class Handler(BaseHTTPRequestHandler):
            timeout = _TIMEOUT_S

            def do_GET(self) -> None:  # noqa: N802 (the http.server hook's name)
                payload = routes.get(self.path.split("?", 1)[0].rstrip("/"))
                if payload is None:
                    self.send_error(404, f"kvferry answers GET {', '.join(routes)} only")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, fmt, *args) -> None:
                log.debug("query server: " + fmt, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="kvferry-query", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(2)


class KvferryAddresses:
    """Decode's map from a bootstrap address a request names to kvferry's
    ZMQ bootstrap server there: the address itself, or, where it answers
    ``GET /kvferry`` (a prefill that serves the bootstrap: the port speaks
    HTTP), the port that names. Asked once per address and cached; a ZMQ
    port is told by the first byte of its greeting (0xFF), which it sends
    at once; an address that does not answer within ``timeout_s`` is taken
    as it is, and asked again next time."""

    def __init__(self, timeout_s: float = 1.0) -> None:
        self.timeout_s = timeout_s
        self._known: dict[str, str] = {}
        self._lock = threading.Lock()

    def __call__(self, addr: str) -> str:
        with self._lock:
            known = self._known.get(addr)
        if known is not None:
            return known
        try:
            found = _front_door(addr, self.timeout_s)
        except OSError as exc:  # refused, unreachable, timed out: not known yet
            log.debug("kvferry: %s not answering GET /kvferry yet: %s", addr, exc)
            return addr
        with self._lock:
            self._known[addr] = found
        return found


def _front_door(addr: str, timeout_s: float) -> str:
    """kvferry's ZMQ bootstrap address behind ``addr`` (see :class:`KvferryAddresses`)."""
    host, _, port = addr.rpartition(":")
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(f"GET /kvferry HTTP/1.0\r\nHost: {addr}\r\n\r\n".encode())
        data = b""
        while True:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if data == b"" and chunk[:1] == b"\xff":
                return addr  # ZMTP's greeting: kvferry's ZMQ bootstrap itself
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        if head.split(b" ", 2)[1] != b"200":
            return addr  # another HTTP server: not a front door
        return f"{host}:{int(json.loads(body)['port'])}"
    except (IndexError, ValueError, KeyError, TypeError):
        return addr
