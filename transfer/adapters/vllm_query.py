"""``GET /query`` for vLLM's Mooncake routers, on a prefill worker.

vLLM's MooncakeConnector routers ask each prefill instance's bootstrap
server over HTTP for its engine (``GET /query``) before they post a request
to prefill and decode at once. kvferry's bootstrap server speaks ZMQ, not
HTTP; this small server answers that one route on its own port
(``kvferry_query_port``) with :func:`~transfer.adapters.vllm_params.query_reply`,
so such a router works against kvferry unchanged. Any other path is a 404.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("kvferry.vllm")

_TIMEOUT_S = 5.0  # a client that stalls mid-request is dropped after this


class QueryServer:
    """Serves ``body`` (JSON) at ``GET /query`` on ``host:port`` from a daemon thread."""

    def __init__(self, host: str, port: int, body: dict) -> None:
        payload = json.dumps(body).encode()

        class Handler(BaseHTTPRequestHandler):
            timeout = _TIMEOUT_S

            def do_GET(self) -> None:  # noqa: N802 (the http.server hook's name)
                if self.path.split("?", 1)[0].rstrip("/") != "/query":
                    self.send_error(404, "kvferry answers GET /query only")
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
