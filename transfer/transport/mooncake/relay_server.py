"""The relay's metadata store: a process of its own that answers Mooncake's
HTTP metadata protocol on loopback, for the engines of the one process that
started it (:mod:`transfer.transport.mooncake.relay`).

Run as ``python -I -S relay_server.py TOKEN``: the standard library's
sockets, selectors and json only (no site packages, nothing of kvferry, not
``http.server``, whose imports alone took 60 ms and 8 MB here), so it starts
in about 40 ms. It prints its port on standard output, then serves until its
standard input closes (its parent exited, however it died).

Protocol: Mooncake's, under the path ``/TOKEN/metadata`` (the token is a
random secret of the parent's: another local process cannot reach the
store without it): ``GET ?key=K`` (200 and the value, 404 when absent),
``PUT ?key=K`` with the value as body, ``DELETE ?key=K``; and kvferry's own
``GET /TOKEN/entries?suffix=S``, a JSON object of every key ending in
``S`` and its value (the entries a segment name owns), and ``PUT
/TOKEN/entries`` with such an object as body (a peer's entries, in one
request). HTTP/1.1 with keep-alive and ``Expect: 100-continue`` (libcurl
sends it before a large body). One thread serves every connection without
blocking on any: a connection idle for ``_IDLE_S`` is closed, so none can
hold the store.
"""

import json
import os
import selectors
import socket
import sys
import time

_IDLE_S = 30.0
_MAX_REQUEST_BYTES = 16 << 20
_REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
            413: "Payload Too Large"}


def _unquote(text: str) -> str:
    """Percent-decoding, ``+`` as a space (what curl_easy_escape and urllib's quote encode)."""
    if "%" not in text and "+" not in text:
        return text
    raw, out, i = text.encode(), bytearray(), 0
    while i < len(raw):
        c = raw[i]
        if c == 0x25 and i + 3 <= len(raw):  # "%XY"
            try:
                out.append(int(raw[i + 1:i + 3], 16))
                i += 3
                continue
            except ValueError:
                pass
        out.append(0x20 if c == 0x2B else c)
        i += 1
    return out.decode("utf-8", "replace")


def _query(target: str) -> tuple[str, dict[str, str]]:
    path, _, query = target.partition("?")
    params = {}
    for pair in query.split("&"):
        if pair:
            k, _, v = pair.partition("=")
            params[_unquote(k)] = _unquote(v)
    return path, params


class Store:
    def __init__(self, token: str) -> None:
        self.prefix = f"/{token}/"
        self.data: dict[str, bytes] = {}

    def handle(self, method: str, target: str, body: bytes) -> tuple[int, bytes]:
        path, params = _query(target)
        if not path.startswith(self.prefix):
            return 403, b"forbidden"
        what, key = path[len(self.prefix):], params.get("key", "")
        if what == "metadata":
            if method == "GET":
                value = self.data.get(key)
                return (404, b"not found") if value is None else (200, value)
            if method == "PUT" and key:
                self.data[key] = body
                return 200, b"ok"
            if method == "DELETE":
                self.data.pop(key, None)
                return 200, b"ok"
        elif what == "entries":
            if method == "GET":
                suffix = params.get("suffix", "")
                found = {k: v.decode("utf-8", "replace") for k, v in self.data.items() if suffix and k.endswith(suffix)}
                return 200, json.dumps(found).encode()
            if method == "PUT":
                try:
                    entries = {str(k): str(v).encode() for k, v in json.loads(body).items()}
                except (ValueError, AttributeError):
                    return 400, b"entries must be a JSON object"
                self.data.update(entries)
                return 200, b"ok"
        return 400, b"bad request"


class Conn:
    """One client connection: bytes in, whole requests answered in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.out = b""
        self.seen = time.monotonic()
        self.continued = False  # 100 Continue sent for the request in the buffer

    def requests(self, store: Store) -> bool:
        """Answer every whole request in the buffer; False: close the connection."""
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return len(self.buf) <= 65536
            lines = self.buf[:head_end].decode("latin-1").split("\r\n")
            try:
                method, target, _ = lines[0].split(" ", 2)
            except ValueError:
                return False
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            try:
                size = int(headers.get("content-length", "0") or 0)
            except ValueError:
                return False
            if not 0 <= size <= _MAX_REQUEST_BYTES:
                self.reply(413, b"too large", close=True)
                return False
            if len(self.buf) < head_end + 4 + size:
                if headers.get("expect", "").lower() == "100-continue" and not self.continued:
                    self.out += b"HTTP/1.1 100 Continue\r\n\r\n"
                    self.continued = True
                return True
            body = self.buf[head_end + 4:head_end + 4 + size]
            self.buf = self.buf[head_end + 4 + size:]
            self.continued = False
            code, payload = store.handle(method, target, body)
            close = headers.get("connection", "").lower() == "close"
            self.reply(code, payload, close=close)
            if close:
                return False

    def reply(self, code: int, body: bytes, close: bool = False) -> None:
        head = (f"HTTP/1.1 {code} {_REASONS.get(code, 'Error')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n")
        self.out += head.encode() + body


def serve(token: str, stdin_fd: int) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    listener.setblocking(False)
    sys.stdout.write(f"{listener.getsockname()[1]}\n")
    sys.stdout.flush()
    store, sel, conns = Store(token), selectors.DefaultSelector(), {}
    sel.register(listener, selectors.EVENT_READ, "listen")
    sel.register(stdin_fd, selectors.EVENT_READ, "stdin")
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "stdin":
                if not os.read(stdin_fd, 4096):
                    return  # the parent is gone
                continue
            if key.data == "listen":
                try:
                    sock, _ = listener.accept()
                except OSError:
                    continue
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns[sock] = Conn(sock)
                sel.register(sock, selectors.EVENT_READ, "conn")
                continue
            conn = conns[key.fileobj]
            alive = True
            try:
                data = conn.sock.recv(1 << 16)
                if data:
                    conn.seen = time.monotonic()
                    conn.buf += data
                    alive = conn.requests(store)
                else:
                    alive = False
                if conn.out:
                    conn.sock.setblocking(True)  # replies are small; a client that does not read them is cut
                    conn.sock.settimeout(2.0)
                    conn.sock.sendall(conn.out)
                    conn.sock.setblocking(False)
                    conn.out = b""
            except OSError:
                alive = False
            if not alive:
                sel.unregister(conn.sock)
                conn.sock.close()
                del conns[conn.sock]
        now = time.monotonic()
        for sock in [s for s, c in conns.items() if now - c.seen > _IDLE_S]:
            sel.unregister(sock)
            sock.close()
            del conns[sock]


if __name__ == "__main__":
    serve(sys.argv[1], sys.stdin.fileno())
