"""A Mooncake Store cluster on loopback for tests: a mooncake_master bound to
127.0.0.1 on free ports and, optionally, a mooncake_client process holding the
pool's memory; stopped (SIGTERM, then SIGKILL) by ``stop()``."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from transfer.storage.base import open_storage


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"{name} is not installed next to {sys.executable}")
    return str(path)


def _die_with_parent() -> None:
    """In the child: SIGKILL it when the test process dies, even without a teardown (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class MooncakeCluster:
    """A mooncake_master (and optionally a mooncake_client holding
    ``holder_bytes`` of pool memory) on 127.0.0.1, as child processes."""

    def __init__(self, log_dir: Path, *, holder_bytes: int = 0) -> None:
        if importlib.util.find_spec("mooncake") is None:  # not imported: the Store reads MC_LOG_LEVEL on import
            pytest.skip("the Mooncake Store is not installed")
        self.log_dir = log_dir
        self.port = free_port()
        self.master_addr = f"127.0.0.1:{self.port}"
        self.url = f"mooncake://{self.master_addr}?protocol=tcp&local_hostname=127.0.0.1"
        self._env = dict(os.environ, MC_LOG_LEVEL="ERROR")
        self.holder = None
        self.start_master()
        try:
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

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        try:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self._env, preexec_fn=_die_with_parent)
        finally:
            log.close()

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def _wait_for_port(self, port: int, proc: subprocess.Popen, name: str, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"{name} did not listen on {port} within {timeout_s} s:\n{self.log(name)}")

    def _wait_for_holder(self, timeout_s: float = 15.0) -> None:
        """Until a put succeeds, i.e. the holder's memory is mounted."""
        probe = (ctypes.c_char * 64)()
        key = f"probe-{uuid.uuid4().hex}"
        with open_storage(self.url, call_timeout_s=5.0) as store:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.holder.poll() is not None:
                    raise RuntimeError(f"holder exited with {self.holder.returncode}:\n{self.log('holder')}")
                if store.put([key], [[(ctypes.addressof(probe), 64)]]) == [True]:
                    return
                time.sleep(0.1)
        raise RuntimeError(f"the holder's memory was not usable within {timeout_s} s:\n{self.log('holder')}")

    def start_master(self) -> None:
        """Start the master (again, after ``kill_master``) on the same port."""
        self.master = self._spawn("master", [
            _tool("mooncake_master"), f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
            "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}", "--enable_metric_reporting=false",
            "--rpc_thread_num=2"])
        try:
            self._wait_for_port(self.port, self.master, "master")
        except BaseException:
            self.stop()
            raise

    def kill_master(self) -> None:
        self.master.kill()
        self.master.wait(timeout=10)

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
