"""The benchmark between two hosts: an agent on the decode node, and the
prefill node's handle on it.

``python -m benchmarks agent --host H --port P`` (on the decode node)
serves one benchmark at a time over a plain TCP line protocol: each request
and each reply is one JSON object on one line, ``{"v": 1, "op": ...}``;
replies carry ``"ok"`` and, when false, ``"error"``. Operations:

- ``hello``: the agent's machine description and the commands it runs;
- ``spawn`` (``command``, ``args``, ``env``, ``lifetime_s``): start one of
  :data:`benchmarks.hosts.COMMANDS` (decode ranks, the raw receivers)
  here; replies with its ``id`` and ``pid``;
- ``poll`` (``id``, ``offset``): its output from ``offset`` (at most
  256 KiB; ``more`` says whether there is more) and exit status;
- ``write`` (``id``, ``line``): one line (at most 1 KiB) to its stdin;
- ``close_stdin``, ``kill`` (``id``); ``ping``; ``bye`` (ends the session).

Every wait is bounded, so a dead prefill node leaves nothing behind: the
session ends, and every child it started is killed, when the connection
closes, when no request arrives for ``--idle-timeout-s`` (the prefill side
pings every few seconds while it works), or when the agent is stopped; a
child is also killed once it outlives its ``lifetime_s`` (at most
``--max-child-s``). The agent starts processes on request: bind it to an
address of a trusted network only.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from benchmarks.hosts import COMMANDS, ENV_NAME, Child, LocalChild, LocalHost, machine

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 4 << 20
MAX_OUTPUT_CHUNK = 256 << 10
MAX_STDIN_LINE = 1024
log = logging.getLogger("kvferry.bench.agent")


class AgentError(RuntimeError):
    """The agent refused a request, or the connection to it failed."""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    host: str = "127.0.0.1"
    port: int = 0
    idle_timeout_s: float = 60.0  # end a session when the prefill side says nothing for this long
    max_child_s: float = 3600.0  # no child lives longer

    def __post_init__(self) -> None:
        if not (self.idle_timeout_s > 0 and self.max_child_s > 0):
            raise ValueError("AgentConfig.idle_timeout_s and max_child_s must be > 0")


# --- the agent (decode node) --------------------------------------------------------------


class _Session:
    """One prefill node's benchmark: its children live and die with it."""

    def __init__(self, conn: socket.socket, config: AgentConfig) -> None:
        self._conn, self._config = conn, config
        self._children: dict[int, tuple[LocalChild, float]] = {}  # id -> (child, kill deadline)
        self._host = LocalHost()

    def run(self) -> None:
        conn, buf, last = self._conn, b"", time.monotonic()
        conn.settimeout(0.5)
        try:
            while True:
                self._reap()
                try:
                    data = conn.recv(1 << 16)
                except TimeoutError:
                    if time.monotonic() - last > self._config.idle_timeout_s:
                        log.warning("no request for %.0f s: ending the session", self._config.idle_timeout_s)
                        return
                    continue
                except OSError as exc:
                    log.warning("connection lost: %s", exc)
                    return
                if not data:
                    return  # the prefill side closed the connection, or died
                buf, last = buf + data, time.monotonic()
                if len(buf) > MAX_LINE_BYTES and b"\n" not in buf:
                    log.warning("request line over %d bytes: ending the session", MAX_LINE_BYTES)
                    return
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    reply, done = self._handle(line)
                    conn.settimeout(10.0)
                    conn.sendall(json.dumps({"v": PROTOCOL_VERSION, **reply}).encode() + b"\n")
                    conn.settimeout(0.5)
                    if done:
                        return
        except OSError as exc:
            log.warning("connection lost: %s", exc)
        finally:
            self._kill_all()
            conn.close()

    def _handle(self, line: bytes) -> tuple[dict, bool]:
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict) or msg.get("v") != PROTOCOL_VERSION:
                raise AgentError(f"expected a JSON object of protocol version {PROTOCOL_VERSION}")
            op = msg.get("op")
            if op == "bye":
                return {"ok": True}, True
            handler = {"hello": self._hello, "ping": lambda m: {}, "spawn": self._spawn, "poll": self._poll,
                       "write": self._write, "close_stdin": self._close_stdin, "kill": self._kill}.get(op)
            if handler is None:
                raise AgentError(f"unknown op {op!r}")
            return {"ok": True, **handler(msg)}, False
        except (AgentError, ValueError, TypeError, KeyError, OSError) as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, False

    def _hello(self, msg: dict) -> dict:
        return {"machine": machine(), "commands": sorted(COMMANDS)}

    def _spawn(self, msg: dict) -> dict:
        command, args, env = msg["command"], msg.get("args", []), msg.get("env", {})
        if command not in COMMANDS:
            raise AgentError(f"command {command!r} is not one of {sorted(COMMANDS)}")
        if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
            raise AgentError("args must be a list of strings")
        if not (isinstance(env, dict) and all(isinstance(k, str) and ENV_NAME.match(k) and isinstance(v, str)
                                              for k, v in env.items())):
            raise AgentError("env must map KVFERRY_* or MC_* names to strings")
        lifetime_s = min(float(msg.get("lifetime_s", self._config.max_child_s)), self._config.max_child_s)
        child = self._host.spawn(command, args, env)
        self._children[child.pid] = (child, time.monotonic() + lifetime_s)
        log.info("started %s (pid %d, at most %.0f s)", command, child.pid, lifetime_s)
        return {"id": child.pid, "pid": child.pid}

    def _child(self, msg: dict) -> LocalChild:
        entry = self._children.get(msg.get("id"))
        if entry is None:
            raise AgentError(f"no child {msg.get('id')!r} in this session")
        return entry[0]

    def _poll(self, msg: dict) -> dict:
        child, offset = self._child(msg), int(msg.get("offset", 0))
        rc = child.returncode()  # first: output read after the exit is complete
        data = child.read_bytes(offset, MAX_OUTPUT_CHUNK)
        return {"returncode": rc, "output": data.decode("utf-8", "replace"), "next_offset": offset + len(data),
                "more": len(data) == MAX_OUTPUT_CHUNK}

    def _write(self, msg: dict) -> dict:
        line = msg.get("line")
        if not isinstance(line, str) or len(line) > MAX_STDIN_LINE or "\n" in line:
            raise AgentError(f"line must be a string of at most {MAX_STDIN_LINE} characters, without a newline")
        self._child(msg).send_line(line)
        return {}

    def _close_stdin(self, msg: dict) -> dict:
        self._child(msg).close_stdin()
        return {}

    def _kill(self, msg: dict) -> dict:
        self._child(msg).kill()
        return {}

    def _reap(self) -> None:
        now = time.monotonic()
        for pid, (child, deadline) in self._children.items():
            if now > deadline and child.returncode() is None:
                log.warning("%s (pid %d) outlived its lifetime: killed", child.name, pid)
                child.kill()

    def _kill_all(self) -> None:
        for pid, (child, _) in self._children.items():
            if child.returncode() is None:
                log.warning("session ended: killing %s (pid %d)", child.name, pid)
            child.close()
        self._children.clear()


def serve(config: AgentConfig) -> None:
    """Serve sessions one after another until stopped (SIGTERM/SIGINT)."""
    srv = socket.create_server((config.host, config.port))
    srv.settimeout(1.0)
    host, port = srv.getsockname()[:2]
    print(f"kvferry bench agent listening on {host}:{port}", flush=True)
    try:
        while True:
            try:
                conn, peer = srv.accept()
            except TimeoutError:
                continue
            log.info("session from %s:%d", *peer[:2])
            _Session(conn, config).run()
            log.info("session from %s:%d ended", *peer[:2])
    finally:
        srv.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks agent",
                                 description="run the decode side of a two-host benchmark on this node")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (a trusted network's)")
    ap.add_argument("--port", type=int, default=0, help="port (0 picks one; the line printed names it)")
    ap.add_argument("--idle-timeout-s", type=float, default=AgentConfig.idle_timeout_s)
    ap.add_argument("--max-child-s", type=float, default=AgentConfig.max_child_s)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[agent] %(asctime)s %(levelname)s %(message)s")
    config = AgentConfig(host=args.host, port=args.port, idle_timeout_s=args.idle_timeout_s,
                         max_child_s=args.max_child_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))  # unwinds through the session: children are killed
    serve(config)
    return 0


# --- the prefill node's handle on an agent --------------------------------------------------


class AgentHost:
    """The decode side on another node, through its agent (see the module
    docstring). Every call is bounded by ``call_timeout_s``; a thread pings
    every ``heartbeat_s`` so the agent knows this side is alive."""

    def __init__(self, address: str, *, connect_timeout_s: float = 10.0, call_timeout_s: float = 30.0,
                 heartbeat_s: float = 5.0) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"agent address must be host:port, got {address!r}")
        self.name = address
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=connect_timeout_s)
        except OSError as exc:
            raise AgentError(f"cannot reach the agent at {address}: {exc}") from exc
        self._sock.settimeout(call_timeout_s)
        self._reader = self._sock.makefile("rb")
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.machine = self.call("hello")["machine"]
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), name="agent-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def call(self, op: str, **fields) -> dict:
        """One request and its reply; raises AgentError."""
        request = json.dumps({"v": PROTOCOL_VERSION, "op": op, **fields}).encode() + b"\n"
        with self._lock:
            if self._closed.is_set():
                raise AgentError(f"the connection to the agent at {self.name} is closed")
            try:
                self._sock.sendall(request)
                line = self._reader.readline(MAX_LINE_BYTES + 1)
            except OSError as exc:  # socket.timeout included
                self._closed.set()
                raise AgentError(f"agent at {self.name}: {op} failed: {exc}") from exc
            if not line.endswith(b"\n"):
                self._closed.set()
                raise AgentError(f"agent at {self.name} closed the connection during {op}")
        reply = json.loads(line)
        if reply.get("v") != PROTOCOL_VERSION:
            raise AgentError(f"agent at {self.name} speaks protocol {reply.get('v')!r}, not {PROTOCOL_VERSION}")
        if not reply.get("ok"):
            raise AgentError(f"agent at {self.name} refused {op}: {reply.get('error')}")
        return reply

    def _beat(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s):
            try:
                self.call("ping")
            except AgentError:
                return

    def spawn(self, command: str, args: list[str], env: dict[str, str] | None = None,
              lifetime_s: float = 3600.0) -> RemoteChild:
        """Start ``command`` on the agent's node; it is killed after ``lifetime_s``."""
        reply = self.call("spawn", command=command, args=args, env=env or {}, lifetime_s=lifetime_s)
        return RemoteChild(self, command, reply["id"], reply["pid"])

    def close(self) -> None:
        """End the session (the agent kills what is still running)."""
        if self._closed.is_set():
            return
        try:
            self.call("bye")
        except AgentError:
            pass
        self._closed.set()
        self._sock.close()

    def __enter__(self) -> AgentHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteChild(Child):
    """A child process on the agent's node."""

    poll_interval_s = 0.1

    def __init__(self, host: AgentHost, name: str, child_id: int, pid: int) -> None:
        super().__init__(f"{name} on {host.name}")
        self._host, self._id, self.pid = host, child_id, pid
        self._offset = 0

    def _pull(self) -> int | None:
        while True:
            reply = self._host.call("poll", id=self._id, offset=self._offset)
            self._offset = reply["next_offset"]
            self.output += reply["output"]
            if not reply["more"]:
                return reply["returncode"]

    def send_line(self, line: str) -> None:
        self._host.call("write", id=self._id, line=line)

    def close_stdin(self) -> None:
        self._host.call("close_stdin", id=self._id)

    def kill(self) -> None:
        try:
            self._host.call("kill", id=self._id)
        except AgentError:
            pass  # the connection is gone: the agent kills the session's children itself
