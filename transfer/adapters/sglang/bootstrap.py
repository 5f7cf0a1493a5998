"""SGLang's bootstrap server slot, filled by kvferry's bootstrap server behind
SGLang's own HTTP front.

The prefill TokenizerManager starts it on ``--disaggregation-bootstrap-port``
(8998) and ``--host``. SGLang's decode speaks HTTP to that address itself
(``/query_dp_ranks``: which prefill DP rank holds a room, when the prefill's
``--load-balance-method`` is not ``follow_bootstrap_room``), so the port
serves HTTP (:class:`FrontDoor`): SGLang's ``/register_dp_rank`` and
``/query_dp_ranks``, and ``/kvferry``, where kvferry's ranks learn the port
of kvferry's own bootstrap server (ZMQ, by default the next port) and the
prefill's DP routing. Prefill ranks register there, decode ranks look them up
(:func:`kvferry_address` maps a request's ``bootstrap_host:bootstrap_port``
to it).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from bootstrap.server import BootstrapServer
from transfer.config import Role, manager_config_from_env
from transfer.errors import BootstrapUnavailable

log = logging.getLogger("kvferry.sglang")

#: rooms -> prefill DP rank are forgotten after this long (SGLang's own server: its cleanup interval)
ROOM_TTL_S = 600.0
MAX_ROOMS = 1 << 20


def bind_host(host: str | None) -> str:
    """SGLang's ``--host`` as a ZMQ bind address."""
    if not host or host == "localhost":
        return "127.0.0.1"
    return host


class FrontDoor:
    """The HTTP side of the bootstrap port: SGLang's room -> prefill DP rank
    registry (``POST /register_dp_rank``, ``POST /query_dp_ranks``), and
    ``GET /kvferry``: ``{"port": <kvferry's bootstrap port>, "follow_bootstrap_room": ...,
    "dp_size": ..., "prefill_http_port": ...}`` (all but the first once a
    prefill rank posted them to ``POST /kvferry``; ``prefill_http_port``, the
    prefill server's HTTP API port, is where SGLang's decode posts a PD
    retract rebootstrap's ``/generate``). ``GET /health`` answers 200."""

    def __init__(self, host: str, port: int, kvferry_port: int) -> None:
        self.kvferry_port = kvferry_port
        self.prefill: dict = {}
        self._rooms: dict[int, tuple[int, float]] = {}
        self._lock = threading.Lock()
        door = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # no line per request on stderr
                pass

            def do_GET(self) -> None:
                if self.path == "/kvferry":
                    self._reply(200, {"port": door.kvferry_port, **door.prefill})
                elif self.path == "/health":
                    self._reply(200, {"ok": True})
                else:
                    self._reply(404, {"error": f"no {self.path} here"})

            def do_POST(self) -> None:
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                    if self.path == "/register_dp_rank":
                        door.register(int(body["bootstrap_room"]), int(body["dp_rank"]))
                        self._reply(200, {"ok": True})
                    elif self.path == "/query_dp_ranks":
                        self._reply(200, door.query([int(r) for r in body["bootstrap_rooms"]]))
                    elif self.path == "/kvferry":
                        prefill = {"follow_bootstrap_room": bool(body["follow_bootstrap_room"]),
                                   "dp_size": int(body["dp_size"])}
                        if body.get("prefill_http_port") is not None:
                            prefill["prefill_http_port"] = int(body["prefill_http_port"])
                        door.prefill = prefill
                        self._reply(200, {"ok": True})
                    else:
                        self._reply(404, {"error": f"no {self.path} here"})
                except (ValueError, KeyError, TypeError) as exc:
                    self._reply(400, {"error": f"bad request: {exc}"})

            def _reply(self, code: int, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer((host, port), Handler)
        self.http.daemon_threads = True
        self.port = self.http.server_address[1]
        self._thread = threading.Thread(target=self.http.serve_forever, name="kvferry-sglang-http", daemon=True)
        self._thread.start()

    def register(self, room: int, dp_rank: int) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._rooms) >= MAX_ROOMS:
                for r in [r for r, (_, t) in self._rooms.items() if now - t > ROOM_TTL_S] or \
                        list(self._rooms)[:len(self._rooms) // 2]:
                    del self._rooms[r]
            self._rooms[room] = (dp_rank, now)

    def query(self, rooms: list[int]) -> dict[str, int]:
        with self._lock:
            return {str(r): self._rooms[r][0] for r in rooms if r in self._rooms}

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


class KvferryKVBootstrapServer(BaseKVBootstrapServer):
    """SGLang's HTTP on its bootstrap port (:class:`FrontDoor`), kvferry's
    bootstrap server on ``KVFERRY_SGLANG_BOOTSTRAP_PORT`` (default: the next
    port, so that a restarted prefill server keeps the address decode
    learned; 0: any free port)."""

    def __init__(self, host: str, port: int) -> None:
        secret = manager_config_from_env(Role.PREFILL).secret or None
        own_port = os.environ.get("KVFERRY_SGLANG_BOOTSTRAP_PORT", "")
        own_port = int(port) + 1 if own_port.strip() == "" else int(own_port)
        self.server = BootstrapServer(bind_host(host), own_port, secret=secret).start()
        try:
            self.door = FrontDoor(bind_host(host), int(port), self.server.port)
        except BaseException:
            self.server.close()
            raise
        self.host, self.port = self.server.host, self.door.port
        log.info("kvferry bootstrap server listening on %s (SGLang's HTTP on port %d)", self.server.address,
                 self.door.port)

    def close(self) -> None:
        self.door.close()
        self.server.close()


# --- the ranks' side ------------------------------------------------------------------

_resolved: dict[str, dict] = {}
_resolved_lock = threading.Lock()


def front_info(addr: str, timeout_s: float) -> dict | None:
    """``GET http://<addr>/kvferry`` (cached once it names the prefill's DP
    routing); None when it does not answer within ``timeout_s``."""
    with _resolved_lock:
        info = _resolved.get(addr)
    if info is not None:
        return info
    try:
        with urllib.request.urlopen(f"http://{addr}/kvferry", timeout=timeout_s) as reply:
            info = json.loads(reply.read())
    except (OSError, ValueError, urllib.error.URLError) as exc:
        log.debug("kvferry front door at %s not answering: %s", addr, exc)
        return None
    if "dp_size" in info:
        with _resolved_lock:
            _resolved[addr] = info
    return info


def kvferry_address(addr: str, timeout_s: float) -> str | None:
    """kvferry's bootstrap address behind SGLang's bootstrap ``host:port``."""
    info = front_info(addr, timeout_s)
    return None if info is None else f"{addr.rsplit(':', 1)[0]}:{int(info['port'])}"


def wait_kvferry_address(addr: str, timeout_s: float) -> str:
    """:func:`kvferry_address`, retried until ``timeout_s`` (a prefill rank
    may start before its TokenizerManager opened the bootstrap port)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = kvferry_address(addr, 1.0)
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise BootstrapUnavailable(f"SGLang bootstrap port {addr}: no kvferry bootstrap server answered "
                                       f"GET /kvferry within {timeout_s:g} s")
        time.sleep(0.2)


def post(addr: str, path: str, body: dict, timeout_s: float = 5.0) -> bool:
    """``POST http://<addr><path>`` with a JSON body; whether it answered 200."""
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError) as exc:
        log.warning("POST %s%s failed: %s", addr, path, exc)
        return False


class RoomRegistrar:
    """Registers prefill rooms with the front door's room -> DP rank registry
    on a thread of its own (the scheduler's thread never waits on HTTP)."""

    def __init__(self, addr: str, dp_rank: int) -> None:
        self.addr, self.dp_rank = addr, dp_rank
        self._queue: queue.Queue[int] = queue.Queue()
        threading.Thread(target=self._run, name="kvferry-sglang-rooms", daemon=True).start()

    def register(self, room: int) -> None:
        self._queue.put(room)

    def _run(self) -> None:
        while True:
            room = self._queue.get()
            post(self.addr, "/register_dp_rank", {"bootstrap_room": room, "dp_rank": self.dp_rank})
