"""Start ``python -m MODULE`` rank processes by forking a warm interpreter.

A rank process spends about 3 CPU-s importing torch on the 2-core
development VM, more than most end-to-end tests spend moving bytes; the
suites start hundreds of them. With ``KVFERRY_FORKSERVER=1`` (set by
``tests/conftest.py``) :func:`spawn_module` asks a fork server, one per
calling process, started on first use, that imported torch, numpy and
msgpack once and nothing else: it forks, and the child runs the module exactly as
``python -m`` would (``sys.argv``, ``sys.path[0]``, environment, working
directory, standard streams, ``atexit`` handlers, exit status). The child is
a separate process like any other; nothing of kvferry, Mooncake, NIXL or zmq
is loaded before the fork, and the server runs no threads of its own.

The handle returned is the part of :class:`subprocess.Popen` the harness
uses (``pid``, ``stdin``, ``stdout``, ``poll``, ``wait``, ``kill``,
``terminate``, ``send_signal``, ``returncode``). Without the variable, or
where the server cannot start, :func:`spawn_module` is ``subprocess.Popen``
of ``python -m MODULE``.

Run as ``python -m harness.forkserver SOCKET``: the server itself.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

ENV = "KVFERRY_FORKSERVER"
# More modules for the server to import before it forks (comma-separated; an
# engine's suite preloads the engine): children that ask for others fork from another server.
PRELOAD_ENV = "KVFERRY_FORKSERVER_PRELOAD"
_PRELOAD = ("torch", "numpy", "msgpack")
_STATUS = struct.Struct("!qi")  # pid, then the exit code as Popen reports it (negative: signal)
# Variables read when the interpreter, torch or its libraries start: children
# whose values differ fork from different servers.
_STARTUP_PREFIXES = ("PYTHON", "LD_", "MALLOC", "OMP_", "MKL_", "OPENBLAS_", "TORCH_", "GOMP_", "KMP_")


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


# --- the client side -------------------------------------------------------------------------

class ForkedProcess:
    """A child of the fork server; the subset of ``subprocess.Popen`` the harness uses."""

    def __init__(self, conn: socket.socket, pid: int, stdin, stdout) -> None:
        self._conn, self.pid, self.stdin, self.stdout = conn, pid, stdin, stdout
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _read_status(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            self._conn.settimeout(timeout)
            try:
                data = self._conn.recv(_STATUS.size, socket.MSG_WAITALL)
            except (TimeoutError, BlockingIOError):
                return None
            except OSError:
                data = b""
            if len(data) != _STATUS.size:  # the server went away: nobody can reap the child now
                self.returncode = -signal.SIGKILL if not _alive(self.pid) else None
                return self.returncode
            self.returncode = _STATUS.unpack(data)[1]
            self._conn.close()
            return self.returncode

    def poll(self) -> int | None:
        return self._read_status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked python pid {self.pid}", timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if (k.startswith(_STARTUP_PREFIXES) and k != "PYTHONUNBUFFERED") or k == PRELOAD_ENV}


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvferry-fork-")
        self.path = os.path.join(self.dir, "s")
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.forkserver", self.path], env=env,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise OSError(f"the fork server did not start (exit {self.proc.poll()})")
            time.sleep(0.02)
        atexit.register(self.close)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


_MAX_SERVERS = 4  # one per distinct start-up environment; beyond that, exec
_servers: dict[tuple, _Server] = {}
_servers_lock = threading.Lock()


def _get_server(env: dict[str, str]) -> _Server | None:
    """The server for ``env``'s start-up variables: started on first use."""
    key = tuple(sorted(_startup_env(env).items()))
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and server.proc.poll() is not None:
            del _servers[key]
            server = None
        if server is None and len(_servers) < _MAX_SERVERS:
            try:
                server = _servers[key] = _Server(env)
            except OSError as exc:
                print(f"harness.forkserver: {exc}; starting processes with exec", file=sys.stderr)
        return server


def spawn_module(module: str, args: list[str], *, env: dict[str, str], cwd: str | None = None,
                 stdin=None, stdout=None, stderr=None, text: bool = False, start_new_session: bool = False):
    """``subprocess.Popen([python, "-m", module, *args], ...)``, by fork from
    the warm server where :func:`enabled`. ``stdin``/``stdout`` take
    ``subprocess.PIPE``, a file object or None; ``stderr`` also
    ``subprocess.STDOUT`` (not ``PIPE``: a forked child's handle has no
    ``stderr``). ``start_new_session``: the child leads a session and
    process group of its own, as with Popen (a forked child makes it first
    thing, so a group kill sent before then finds no group: kill the pid)."""
    if stderr == subprocess.PIPE:
        raise ValueError("spawn_module: stderr=PIPE is not supported; use subprocess.STDOUT or a file")
    server = _get_server(env) if enabled() else None
    if server is None:
        return subprocess.Popen([sys.executable, "-m", module, *args], env=env, cwd=cwd, stdin=stdin,
                                stdout=stdout, stderr=stderr, text=text, start_new_session=start_new_session)
    ours, close_after = [], []  # our pipe ends; fds to close once sent

    def child_end(spec, fallback: int, write: bool) -> int:
        if spec is None:
            return fallback
        if spec == subprocess.PIPE:
            r, w = os.pipe()
            mine, child = (r, w) if write else (w, r)
            ours.append(mine)
            close_after.append(child)
            return child
        if spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            close_after.append(fd)
            return fd
        return spec if isinstance(spec, int) else spec.fileno()

    fd_in = child_end(stdin, 0, write=False)
    fd_out = child_end(stdout, 1, write=True)
    fd_err = fd_out if stderr == subprocess.STDOUT else child_end(stderr, 2, write=True)
    request = json.dumps({"module": module, "args": list(args), "env": env, "cwd": cwd or os.getcwd(),
                          "new_session": start_new_session}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(30)
        conn.connect(server.path)
        socket.send_fds(conn, [struct.pack("!I", len(request)) + request], [fd_in, fd_out, fd_err])
        data = conn.recv(8, socket.MSG_WAITALL)
        if len(data) != 8:
            raise OSError("the fork server did not answer")
        pid = struct.unpack("!q", data)[0]
    finally:
        for fd in close_after:
            os.close(fd)
    pipe_in = pipe_out = None
    if stdin == subprocess.PIPE:
        pipe_in = open(ours.pop(0), "w" if text else "wb", **({"encoding": "utf-8"} if text else {}))
    if stdout == subprocess.PIPE:
        pipe_out = open(ours.pop(0), "r" if text else "rb", **({"encoding": "utf-8"} if text else {}))
    return ForkedProcess(conn, pid, pipe_in, pipe_out)


# --- the server side -------------------------------------------------------------------------

def _serve(path: str):
    """Answer spawn requests until the parent goes; in a forked child,
    return the function that runs its module (the caller's stack unwound)."""
    for name in (*_PRELOAD, *filter(None, os.environ.get(PRELOAD_ENV, "").split(","))):
        __import__(name)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for the name: it appears once we listen
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            conn, _ = listener.accept()
            conn.settimeout(30)
            try:
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                size = struct.unpack("!I", msg[:4])[0]
                while len(msg) < 4 + size:
                    msg += conn.recv(4 + size - len(msg))
                request = json.loads(msg[4:4 + size])
            except (OSError, ValueError, struct.error):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                conn.close()
                return lambda: _run_child(request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(struct.pack("!q", pid))
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(_STATUS.pack(pid, os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()
    return None


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python -m MODULE ARGS``."""
    import runpy

    if request.get("new_session"):
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # the temp directory as the request's TMPDIR says, not as the server found it
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
    sys.argv = ["-m", *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    child = _serve(sys.argv[1])
    if child is not None:
        child()
