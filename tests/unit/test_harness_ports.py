"""The test harness's port choice and its report of crashed servers.

Ports a test names for a server it starts later come from a band the
kernel never hands out by itself (an ephemeral port taken meanwhile by a
connection or a ``bind(0)`` is how NIXL's side channel found its port
taken in CI) and that Mooncake's engines do not pick from."""

import socket
import sys
import time

import pytest

from harness import ports
from harness.vllm import ServerProcess, failure_report


def test_ports_lie_outside_the_ephemeral_range_and_mooncakes_and_never_repeat():
    eph_low, eph_high = ports._ephemeral()
    got = [ports.free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    for port in got:
        assert not eph_low <= port < eph_high, (port, eph_low, eph_high)
        assert not 15000 <= port < 17000, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out (nothing here took it since)


def test_ports_handed_out_leave_room_for_a_servers_offsets():
    got = sorted(ports.free_port() for _ in range(50))
    assert all(b - a > ports.GAP for a, b in zip(got, got[1:])), got


def test_consecutive_ports_are_all_free_and_not_handed_out_again():
    base = ports.free_ports(8)
    block = set(range(base, base + 8))
    assert block <= ports._GIVEN
    assert block.isdisjoint(ports.free_port() for _ in range(200))


class _Proc(ServerProcess):
    def __init__(self, tmp_path, name: str, code: str) -> None:
        self.spec = type("Spec", (), {"name": name})()
        self.log_path = str(tmp_path / f"{name}.log")
        self._spawn([sys.executable, "-c", code], {})


def test_a_failed_tests_report_shows_a_crashed_servers_log_and_not_a_closed_ones(tmp_path):
    crashed = _Proc(tmp_path, "crashed", "import sys; print('engine core died: boom', flush=True); sys.exit(3)")
    closed = _Proc(tmp_path, "closed", "import sys; print('kvferry: fine', flush=True); sys.exit(0)")
    crashed.proc.wait(30)
    closed.proc.wait(30)
    closed.close()
    try:
        report = dict(failure_report())
        assert "engine core died: boom" in report["crashed: exited with 3"]
        assert not any(title.startswith("closed") for title in report)
    finally:
        crashed.close()
    assert not any(title.startswith("crashed") for title, _ in failure_report())


def test_a_failed_tests_report_shows_a_live_servers_error_lines_with_the_line_after(tmp_path):
    code = ("import sys, time\n"
            "print('INFO serving', flush=True)\n"
            "print('ERROR handshake_failed: timed out', flush=True)\n"
            "print('  frame after it', flush=True)\n"
            "print('INFO fine again', flush=True)\n"
            "time.sleep(60)\n")
    live = _Proc(tmp_path, "live", code)
    try:
        deadline = time.monotonic() + 30
        while "fine again" not in live.log_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        report = dict(failure_report())
        assert report["live: its last error lines"] == "ERROR handshake_failed: timed out\n  frame after it"
    finally:
        live.close()


def test_kvferrys_lines_leave_out_vllms_request_log_and_a_failures_note_names_the_request(tmp_path):
    code = ("print('(APIServer) INFO [request_logger.py:65] Received request cmpl-7-0: params: "
            "extra_args={\"kv_transfer_params\": {\"kvferry_room\": 42, \"kvferry_node\": \"gone\"}}', flush=True)\n"
            "print('(EngineCore) WARNING [corrupting.py:89] kvferry-test: finished request=cmpl-7-0-a room=42', "
            "flush=True)\n"
            "print('(Worker) WARNING [room_stats.py:43] room failed: side=prefill room=43', flush=True)\n"
            "print('(Worker) WARNING [room_stats.py:43] room failed: side=prefill room=42', flush=True)\n")
    server = _Proc(tmp_path, "prefill", code)
    try:
        server.proc.wait(30)
        assert "gone" not in server.kvferry_lines()  # vLLM's echo of a request's parameters is not kvferry's
        assert server.kvferry_lines().count("\n") == 0 and "finished request=cmpl-7-0-a" in server.kvferry_lines()
        named = server.lines_naming(["cmpl-7", "room=42"])
        assert [line.split("]")[0].split("[")[1] for line in named] == ["request_logger.py:65", "corrupting.py:89",
                                                                       "room_stats.py:43"], named
        assert named[-1].endswith("room=42")
        assert all(len(line) <= 40 for line in server.lines_naming(["cmpl-7"], width=40))
    finally:
        server.close()


def test_a_refusing_address_refuses_and_no_other_socket_can_take_its_port():
    """The port stays refusing while held: a connect is refused, and a
    listener that asks for it (with SO_REUSEADDR, as servers set it) cannot
    bind it, as one bound a closed port that a test had taken for refusing."""
    from harness.ports import refusing_address

    with refusing_address() as address:
        host, port = address.rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=1).close()
        with socket.socket() as rival:
            rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                rival.bind((host, int(port)))
    with socket.socket() as after:  # given back at the block's end
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind((host, int(port)))
