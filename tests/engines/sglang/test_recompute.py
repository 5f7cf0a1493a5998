"""The PD retract rebootstrap's POST in one process (``transfer/adapters/sglang/recompute.py``
and the receiver's poll); the whole path across processes is ``test_rebootstrap.py``."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from harness.ports import free_port
from transfer.adapters.sglang.recompute import (PrefillRecomputeError, PrefillRecomputeTimeout, Recomputer,
                                                post_generate)


def _wait_error(call, bound_s: float):
    """(error, seconds since the call started) once ``call`` has an error; fails past ``bound_s``."""
    while True:
        now = time.monotonic()
        error = call.error(now)
        if error is not None:
            return error, now - call.started
        assert now - call.started < bound_s, "no error within the bound"
        time.sleep(0.01)


def test_a_refused_connection_fails_the_call_at_once_naming_where():
    recomputer = Recomputer(timeout_s=30.0)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    call = recomputer.call(rid="r1", room=42, url=url)
    start = time.monotonic()
    recomputer.submit(call, {"rid": "r1"})
    assert time.monotonic() - start < 0.2  # only queued
    error, after_s = _wait_error(call, 5.0)
    assert type(error) is PrefillRecomputeError and after_s < 5.0
    assert str(error).startswith(f"PD retract rebootstrap of rid r1 (room 42): POST {url}/generate failed:"), error
    assert (error.rid, error.room, error.url, error.status) == ("r1", 42, url, None)
    recomputer.close()


def test_a_server_that_trickles_its_reply_still_fails_the_room_at_the_bound():
    """Each socket read gets a byte in time, so no socket timeout fires: the
    call's own bound, counted from the submit, does."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def trickle():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            while not stop.wait(0.2):
                conn.sendall(b"X-Slow: 1\r\n")

    threading.Thread(target=trickle, daemon=True).start()
    call = Recomputer(timeout_s=1.0).call(rid="r2", room=43, url=f"http://127.0.0.1:{port}")
    threading.Thread(target=post_generate, args=(call, {"rid": "r2"}), daemon=True).start()
    try:
        error, after_s = _wait_error(call, 4.0)
        assert isinstance(error, PrefillRecomputeTimeout) and 1.0 <= after_s < 2.0, (error, after_s)
        assert "not answered within 1 s" in str(error)
    finally:
        stop.set()
        listener.close()


def test_calls_are_posted_side_by_side_up_to_max_workers_and_each_is_answered():
    """Eight calls to a /generate that answers 200 after 0.5 s, four workers:
    two rounds, each call answered once, the submits only queue."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies = []

    class Slow(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(0.5)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    recomputer = Recomputer(timeout_s=30.0, max_workers=4)
    try:
        calls = [recomputer.call(rid=f"r{i}", room=i, url=f"http://127.0.0.1:{server.server_address[1]}")
                 for i in range(8)]
        start = time.monotonic()
        for i, call in enumerate(calls):
            recomputer.submit(call, {"rid": f"r{i}"})
        assert time.monotonic() - start < 0.2
        while not all(c.is_answered for c in calls):
            assert time.monotonic() - start < 10.0, [c.error(time.monotonic()) for c in calls]
            time.sleep(0.02)
        assert time.monotonic() - start >= 1.0  # at most four at a time
        assert all(c.error(time.monotonic()) is None for c in calls)
        assert sorted(bodies) == sorted(f'{{"rid": "r{i}"}}'.encode() for i in range(8))
    finally:
        recomputer.close()
        server.shutdown()
        server.server_close()


def test_closing_fails_the_calls_not_yet_posted():
    recomputer = Recomputer(timeout_s=30.0)
    recomputer.close()
    call = recomputer.call(rid="r3", room=44, url="http://127.0.0.1:1")
    recomputer.submit(call, {})
    assert "closed" in str(call.error(time.monotonic()))


@pytest.mark.parametrize("core_state, want", [("Success", "Success"), ("Transferring", "Failed")])
def test_a_failed_recompute_fails_a_live_room_but_not_one_whose_kv_landed(core_state, want):
    """The receiver's poll on SGLang's thread: the call's error aborts a live
    room (its peers told) and is what ``failure_exception()`` raises; a room
    whose KV already landed stays Success."""
    from transfer.adapters.sglang.receiver import KvferryKVReceiver
    from transfer.state import KVPoll

    class Core:
        def __init__(self) -> None:
            self.state, self.aborted = KVPoll[core_state], None

        def poll(self):
            return self.state

        def abort(self, reason: str) -> None:
            self.aborted, self.state = reason, KVPoll.Failed

    receiver = KvferryKVReceiver(SimpleNamespace(receivers={}), "127.0.0.1:8998", 45)
    receiver._core = core = Core()
    call = Recomputer(timeout_s=30.0).call(rid="r4", room=45, url="http://127.0.0.1:1")
    receiver.watch_recompute(call)
    call.failed("POST answered HTTP 500: nope", status=500)
    assert receiver.poll() == KVPoll[want]
    if want == "Failed":
        assert "answered HTTP 500" in core.aborted
        with pytest.raises(PrefillRecomputeError, match="rid r4 \\(room 45\\).*HTTP 500"):
            receiver.failure_exception()
    else:
        assert core.aborted is None
