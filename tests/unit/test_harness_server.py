"""harness.vllm.ServerProcess, the engines' and routers' server processes:
its scratch directory (vLLM's ZMQ sockets, VLLM_RPC_BASE_PATH) is removed
when it stops, killed or closed (a killed vLLM unlinks none of its ipc
sockets, and they piled up in the temp directory run after run); one that
never becomes ready says where it was stuck."""

import os
import socket
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest

from harness.ports import free_port
from harness.vllm import ServerProcess

BIND = ("import socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1] + '/engine.sock'); s.listen()\n"
        "time.sleep(600)\n")


STUCK = ("import time\n"
         "def stuck_here():\n"
         "    time.sleep(600)\n"
         "stuck_here()\n")


class _Server(ServerProcess):
    def __init__(self, log_dir: str, code: str = BIND) -> None:
        self.spec = SimpleNamespace(name="scratch")
        self.log_path = os.path.join(log_dir, "scratch.log")
        self.url = f"http://127.0.0.1:{free_port()}"  # nothing answers there
        self.scratch = tempfile.mkdtemp(prefix="kvferry-test-scratch-")
        self._spawn([sys.executable, "-c", code, self.scratch], dict(os.environ))
        if code != BIND:
            return
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(self.scratch, "engine.sock")):
            assert self.proc.poll() is None and time.monotonic() < deadline, "the process did not bind"
            time.sleep(0.05)


@pytest.mark.parametrize("stop", ["close", "kill"])
def test_a_stopped_server_leaves_no_socket_behind(tmp_path, stop):
    server = _Server(str(tmp_path))
    with socket.socket(socket.AF_UNIX) as client:
        assert client.connect_ex(os.path.join(server.scratch, "engine.sock")) == 0  # a live socket, as vLLM's
    getattr(server, stop)()
    assert server.proc.returncode is not None
    assert not os.path.exists(server.scratch)


def test_a_server_that_never_becomes_ready_says_where_it_was_stuck(tmp_path):
    server = _Server(str(tmp_path), STUCK)
    try:
        with pytest.raises(TimeoutError, match="not ready within 2 s") as info:
            server.wait_ready(2)
        assert "in stuck_here" in str(info.value), str(info.value)
        assert server.proc.returncode == -6  # SIGABRT, after the stacks
    finally:
        server.close()
