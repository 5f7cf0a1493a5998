"""The Mooncake engine's first write to a peer opens the peer's segment by a
P2P handshake with the peer engine's RPC port, inside the submit call; a
peer whose handshake listener does not answer holds the transport's worker
there (the listener serves one connection at a time: each idle connection
ahead holds it 5 s). Reproduced with a real engine and a listener that
accepts and never answers: a waiting write's description names the stuck
engine round and the handshake, and the worker comes back once the
listener goes."""

import re
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

from transfer.config import EngineConfig  # noqa: E402
from transfer.plan import TransferPlan  # noqa: E402
from transfer.transport.mooncake.transport import MooncakeTransport  # noqa: E402


def test_a_first_write_stuck_in_the_peers_handshake_says_so():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    peer = f"127.0.0.1:{listener.getsockname()[1]}"
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_hold():  # a handshake listener that never answers
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    acceptor = threading.Thread(target=accept_and_hold, daemon=True)
    acceptor.start()
    transport = MooncakeTransport(EngineConfig(hostname="127.0.0.1"))
    src = np.zeros(4096, dtype=np.uint8)
    transport.register([(src.ctypes.data, src.nbytes)])
    done: list = []
    try:
        plan = TransferPlan(np.array([src.ctypes.data], dtype=np.uint64), np.array([1 << 20], dtype=np.uint64),
                            np.array([4096], dtype=np.uint64))
        job = transport.submit(peer, plan, done.append, None)
        deadline = time.monotonic() + 10
        while not held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held, "the engine never connected to the peer's RPC port"
        time.sleep(1.3)
        what = transport.describe_job(job)
        assert "0 submitted" in what and re.search(r"in one engine round for \d+\.\d s", what), what
        assert f"no write to {peer} was taken yet" in what and "P2P handshake" in what, what
    finally:
        stop.set()
        for conn in held:
            conn.close()
        listener.close()
        acceptor.join(5)
    deadline = time.monotonic() + 10  # the handshake fails once the listener is gone: the job ends failed
    while not done and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done and done[0] is not None, done
    transport.close()
