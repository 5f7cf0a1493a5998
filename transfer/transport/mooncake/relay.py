"""The metadata relay: Mooncake's segment descriptors carried by kvferry's
own handshake, not by a handshake with the peer engine's listener.

Why. With ``P2PHANDSHAKE`` a Mooncake engine learns a peer's segment (its
buffers and data port) from the peer's handshake listener, inside its first
write to the peer. That listener is one thread serving one connection at a
time, each given 5 s to speak: one idle connection on it (a port scanner, a
probe that never closes) held a fresh pair's first room 5 s, two held it
10 s, fourteen failed it (docs/reliability.md, "Opening a peer"). And the
write call opens the segment under the engine's one mutex, so every other
transfer of the engine waits too.

How. Every kvferry process that runs a Mooncake engine in ``relay`` mode
starts one :class:`RelayStore` (:func:`relay_store`): a child process
(:mod:`transfer.transport.mooncake.relay_server`) that answers Mooncake's
HTTP metadata protocol on 127.0.0.1, under a random path no other process
knows. The engines are initialized with it as their metadata server, so
Mooncake publishes its own descriptors there and looks peers up there. A
decode rank reads its entries (:meth:`RelayStore.entries`) and sends them
in its ``PeerHello``; the prefill rank puts them into its own store
(:meth:`RelayStore.put`) before its first write to the peer. On TCP the
peer's listener is then never contacted; on RDMA only the endpoints'
connection requests still go to it (Mooncake sends those itself).

The store is a separate process because Mooncake's ``initialize`` holds the
interpreter lock while it publishes: a store thread in this process could
not answer it. It exits when this process's end of its standard input
closes (this process exited, however), and a forked child closes its
inherited copy at once, so the store never outlives the process that
started it. Its cost: one small process (about 15 MB) per kvferry process,
started in tens of milliseconds.

Stale segments: each engine's segment name is new (``host:kvferry-<random>``),
so a restarted peer is a new name and the descriptors of its old engine are
never used for it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
from urllib.parse import quote

from transfer.errors import TransferError

log = logging.getLogger("kvferry.transport")

# A request to the store, which answers in well under a millisecond when this host is not starved.
_TIMEOUT_S = 2.0
_START_TIMEOUT_S = 10.0


class RelayStore:
    """One metadata store process and a client of it (thread-safe)."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay_server.py")
        self._proc = subprocess.Popen([sys.executable, "-I", "-S", script, self.token], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self.pid = os.getpid()
        self.port = 0
        self.url = ""
        self._local = threading.local()

    def wait_ready(self) -> None:
        """Until the store listens (its port read; once). TransferError when it did not start."""
        if self.port:
            return
        line = _read_line(self._proc, _START_TIMEOUT_S)
        if not line.strip().isdigit():
            self._proc.kill()
            raise TransferError(f"kvferry's Mooncake metadata relay did not start within {_START_TIMEOUT_S:g} s "
                                f"(exit {self._proc.poll()}, said {line!r})")
        self.port = int(line)
        #: what Mooncake's engines are initialized with
        self.url = f"http://127.0.0.1:{self.port}/{self.token}/metadata"

    def _request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        """One HTTP/1.1 request on this thread's kept-alive connection to the
        store (the standard library's client costs 45 ms of imports); once
        more on a new connection when the store had closed the old one."""
        request = (f"{method} /{self.token}/{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        for attempt in (0, 1):
            conn = getattr(self._local, "conn", None)
            try:
                if conn is None:
                    conn = self._local.conn = socket.create_connection(("127.0.0.1", self.port), timeout=_TIMEOUT_S)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.sendall(request)
                return _read_reply(conn)
            except OSError as exc:
                if conn is not None:
                    conn.close()
                self._local.conn = None
                if attempt:
                    raise TransferError(f"kvferry's Mooncake metadata relay (pid {self._proc.pid}, port "
                                        f"{self.port}) did not answer {method} {path.split('?')[0]}: "
                                        f"{type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")

    def entries(self, name: str) -> dict[str, str]:
        """Every entry Mooncake published for segment ``name`` (its
        descriptor and its RPC address, under Mooncake's own keys)."""
        status, body = self._request("GET", "entries?suffix=" + quote("/" + name, safe=""))
        if status != 200:
            raise TransferError(f"kvferry's Mooncake metadata relay answered {status} for the entries of {name}")
        return json.loads(body)

    def put(self, entries: dict[str, str]) -> None:
        """Store a peer's entries (what its :meth:`entries` returned), in one request."""
        status, body = self._request("PUT", "entries", json.dumps(entries).encode())
        if status != 200:
            raise TransferError(f"kvferry's Mooncake metadata relay refused {len(entries)} entries: "
                                f"{status} {body[:200]!r}")

    def close(self) -> None:
        """End the store process (the engines using it must be done with it)."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def _read_reply(conn: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one reply (the store always sends Content-Length)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the store closed the connection")
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    size = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                 if k.strip().lower() == "content-length"), 0)
    while len(rest) < size:
        chunk = conn.recv(max(65536, size - len(rest)))
        if not chunk:
            raise ConnectionError("the store closed the connection mid-reply")
        rest += chunk
    return status, rest[:size]


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    import selectors  # noqa: PLC0415 (only at start)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return ""
    return proc.stdout.readline().decode(errors="replace")


_STORE: RelayStore | None = None
_STORE_LOCK = threading.Lock()


def start_relay_store() -> RelayStore:
    """This process's store, its process started if it was not (one per
    process, shared by its Mooncake engines; it ends with the process);
    returns at once: :func:`relay_store` waits until it listens."""
    global _STORE
    with _STORE_LOCK:
        if _STORE is None or _STORE.pid != os.getpid():
            _STORE = RelayStore()
        return _STORE


def relay_store() -> RelayStore:
    """This process's store, listening (started on first use)."""
    store = start_relay_store()
    with _STORE_LOCK:
        store.wait_ready()
    return store


def _after_fork_in_child() -> None:
    """A forked child must not keep its parent's store alive (the store
    exits when every copy of its standard input's write end is closed), nor
    use it: it starts its own on first use."""
    global _STORE
    store, _STORE = _STORE, None
    if store is not None:
        try:
            store._proc.stdin.close()
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
