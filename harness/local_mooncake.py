"""A Mooncake Store on this host, for the tests and the benchmark: a
``mooncake_master`` bound to 127.0.0.1 on a free port and, optionally, a
holder (``mooncake_client`` contributing ``holder_bytes`` of memory), as
child processes that die with this one. Every wait is bounded; ``stop()``
ends both (SIGTERM, then SIGKILL), also after a failed start."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from harness.ports import free_port
from transfer.storage.base import open_storage

START_S = 15.0  # bound on the master listening and the holder's memory being usable


def _tool(name: str) -> str | None:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else shutil.which(name)


def mooncake_missing_reason() -> str:
    """Why no local Mooncake Store can run here, or ``""``."""
    if importlib.util.find_spec("mooncake") is None:  # not imported: the Store reads MC_LOG_LEVEL on import
        return "the Mooncake Store is not installed"
    missing = [t for t in ("mooncake_master", "mooncake_client") if _tool(t) is None]
    return f"{' and '.join(missing)} not found next to {Path(sys.executable).name} or on PATH" if missing else ""


def _die_with_parent() -> None:
    """In the child: SIGKILL it when the parent dies without stopping it (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LocalMooncake:
    """``url`` (``mooncake://127.0.0.1:PORT?protocol=tcp&local_hostname=127.0.0.1``)
    reaches it; logs go to ``log_dir``."""

    def __init__(self, log_dir: Path, *, holder_bytes: int = 0) -> None:
        reason = mooncake_missing_reason()
        if reason:
            raise RuntimeError(reason)
        self.log_dir = Path(log_dir)
        self.port = free_port()
        self.master_addr = f"127.0.0.1:{self.port}"
        self.url = f"mooncake://{self.master_addr}?protocol=tcp&local_hostname=127.0.0.1"
        self.master: subprocess.Popen | None = None
        self.holder: subprocess.Popen | None = None
        try:
            self.start_master()
            if holder_bytes:
                self.holder = self._spawn("holder", [
                    _tool("mooncake_client"), "--host=127.0.0.1", f"--port={free_port()}",
                    f"--global_segment_size={holder_bytes}", "--local_buffer_size=16MB",
                    f"--master_server_address={self.master_addr}", "--metadata_server=P2PHANDSHAKE",
                    "--protocol=tcp"])
                self._wait_for_holder()
        except BaseException:
            self.stop()
            raise

    def start_master(self) -> None:
        """Start the master (again, after ``kill_master``) on the same port."""
        self.master = self._spawn("master", [
            _tool("mooncake_master"), f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
            "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}", "--enable_metric_reporting=false",
            "--rpc_thread_num=2"])
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            self._check_alive("master", self.master)
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"mooncake master did not listen on {self.port} within {START_S} s:\n{self.log('master')}")

    def kill_master(self) -> None:
        self.master.kill()
        self.master.wait(timeout=10)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(os.environ, MC_LOG_LEVEL="ERROR"), preexec_fn=_die_with_parent)

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def _check_alive(self, name: str, proc: subprocess.Popen) -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake {name} exited with {proc.returncode}:\n{self.log(name)}")

    def _wait_for_holder(self) -> None:
        """Until a put succeeds, i.e. the holder's memory is mounted."""
        probe = (ctypes.c_char * 64)()
        key = f"probe-{uuid.uuid4().hex}"
        with open_storage(self.url, call_timeout_s=5.0) as store:
            deadline = time.monotonic() + START_S
            while time.monotonic() < deadline:
                self._check_alive("holder", self.holder)
                if store.put([key], [[(ctypes.addressof(probe), 64)]]) == [True]:
                    return
                time.sleep(0.1)
        raise RuntimeError(f"the holder's memory was not usable within {START_S} s:\n{self.log('holder')}")

    def stop(self) -> None:
        for proc in (self.holder, self.master):
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    close = stop
