"""The relay's metadata store: a process of its own that answers Mooncake's
HTTP metadata protocol on loopback, for the engines of the one process that
started it (:mod:`transfer.transport.mooncake.relay`).

Run as ``python -I -S relay_server.py TOKEN``: the standard library only
(no site packages, nothing of kvferry), so it starts in tens of
milliseconds. It prints its port on standard output, then serves until its
standard input closes (its parent exited, however it died).

Protocol: Mooncake's, under the path ``/TOKEN/metadata`` (the token is a
random secret of the parent's: another local process cannot reach the
store without it): ``GET ?key=K`` (200 and the value, 404 when absent),
``PUT ?key=K`` with the value as body, ``DELETE ?key=K``; and kvferry's own
``GET /TOKEN/entries?suffix=S``, a JSON object of every key ending in
``S`` and its value (the entries a segment name owns), and ``PUT
/TOKEN/entries`` with such an object as body (a peer's entries, in one
request). Every connection
gets ``_IDLE_S`` to speak: an idle one holds one thread, never the store.
"""

import http.server
import json
import sys
import threading
import urllib.parse

_IDLE_S = 5.0
_MAX_VALUE_BYTES = 16 << 20


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, bytes] = {}


def _handler(token: str, store: _Store):
    prefix = f"/{token}/"

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go out together: no 40 ms delayed-ACK stall
        timeout = _IDLE_S

        def log_message(self, *args) -> None:
            pass

        def _route(self) -> tuple[str, dict[str, list[str]]] | None:
            url = urllib.parse.urlsplit(self.path)
            if not url.path.startswith(prefix):
                self._reply(403, b"forbidden")
                return None
            return url.path[len(prefix):], urllib.parse.parse_qs(url.query)

        def _reply(self, code: int, body: bytes = b"", kind: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            route = self._route()
            if route is None:
                return
            what, query = route
            if what == "metadata":
                key = query.get("key", [""])[0]
                with store.lock:
                    value = store.data.get(key)
                if value is None:
                    self._reply(404, b"not found")
                else:
                    self._reply(200, value, "application/json")
            elif what == "entries":
                suffix = query.get("suffix", [""])[0]
                with store.lock:
                    found = {k: v.decode("utf-8", "replace") for k, v in store.data.items()
                             if suffix and k.endswith(suffix)}
                self._reply(200, json.dumps(found).encode(), "application/json")
            else:
                self._reply(404, b"no such resource")

        def do_PUT(self) -> None:
            route = self._route()
            if route is None:
                return
            what, query = route
            key = query.get("key", [""])[0]
            size = int(self.headers.get("Content-Length") or 0)
            if what not in ("metadata", "entries") or (what == "metadata" and not key) \
                    or not 0 <= size <= _MAX_VALUE_BYTES:
                self._reply(400, b"bad request")
                return
            value = self.rfile.read(size)
            if what == "entries":
                try:
                    entries = {str(k): str(v).encode() for k, v in json.loads(value).items()}
                except (ValueError, AttributeError):
                    self._reply(400, b"entries must be a JSON object")
                    return
            else:
                entries = {key: value}
            with store.lock:
                store.data.update(entries)
            self._reply(200, b"ok")

        def do_DELETE(self) -> None:
            route = self._route()
            if route is None:
                return
            with store.lock:
                store.data.pop(route[1].get("key", [""])[0], None)
            self._reply(200, b"ok")

    return Handler


def main() -> int:
    token = sys.argv[1]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(token, _Store()))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="relay-store", daemon=True).start()
    sys.stdout.write(f"{server.server_address[1]}\n")
    sys.stdout.flush()
    sys.stdin.buffer.read()  # until the parent's end of the pipe closes
    return 0


if __name__ == "__main__":
    sys.exit(main())
