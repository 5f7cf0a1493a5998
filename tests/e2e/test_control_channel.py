"""The zmq control channel against a peer in another process: ``link``
tells a peer whose Python threads cannot run (a C call holds its interpreter
lock) from a stopped one and a killed one; ``drain`` hands messages over on
the caller's thread, each once and in order."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from harness.launch import child_env
from transfer.control.base import ChannelOptions, Link
from transfer.control.zmq_channel import ZmqChannel
from transfer.messages import PeerPing

HEARTBEAT_S, TIMEOUT_S = 0.1, 0.6
OPTIONS = ChannelOptions(host="127.0.0.1", heartbeat_interval_s=HEARTBEAT_S, peer_timeout_s=TIMEOUT_S)


@pytest.fixture
def peer():
    proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.channel_peer", "--heartbeat-s", str(HEARTBEAT_S),
                             "--timeout-s", str(TIMEOUT_S)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=child_env())
    line = proc.stdout.readline()
    assert line.startswith("READY "), line
    proc.endpoint = line.split()[1]
    yield proc
    proc.kill()
    proc.wait(10)


@pytest.fixture
def channel():
    ch = ZmqChannel(OPTIONS, lambda msg, origin: None)
    yield ch
    ch.close()


def _wait_link(channel, endpoint: str, want: Link, timeout_s: float) -> float:
    """Seconds until ``channel.link(endpoint)`` is ``want`` (fails after ``timeout_s``)."""
    t0 = time.monotonic()
    while channel.link(endpoint) is not want:
        assert time.monotonic() - t0 < timeout_s, f"link {channel.link(endpoint)}, not {want}, after {timeout_s} s"
        time.sleep(0.01)
    return time.monotonic() - t0


def _connect(channel, peer) -> None:
    assert channel.link(peer.endpoint) is Link.UNKNOWN
    channel.send(peer.endpoint, PeerPing(session="me", endpoint=channel.endpoint, seq=1))
    _wait_link(channel, peer.endpoint, Link.UP, 5.0)


def test_a_peer_whose_interpreter_lock_is_held_stays_up(channel, peer):
    _connect(channel, peer)
    hold_s = 5 * TIMEOUT_S
    peer.stdin.write(f"hold {hold_s}\n")
    peer.stdin.flush()
    seen, t0 = set(), time.monotonic()
    while time.monotonic() - t0 < hold_s - 0.5:
        seen.add(channel.link(peer.endpoint))
        time.sleep(0.02)
    assert seen == {Link.UP}, f"a peer with its Python threads held was seen {seen}"
    assert peer.stdout.readline().strip() == "HELD"  # the hold really lasted that long
    assert time.monotonic() - t0 >= hold_s - 0.5


def test_a_stopped_peer_goes_down_never_gone_and_comes_back(channel, peer):
    _connect(channel, peer)
    peer.send_signal(signal.SIGSTOP)
    try:
        took = _wait_link(channel, peer.endpoint, Link.DOWN, 5.0)
        assert took <= TIMEOUT_S / 2 + 1.0, f"down {took:.2f} s after SIGSTOP"
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4 * TIMEOUT_S:  # reconnections go on: never mistaken for gone
            assert channel.link(peer.endpoint) is Link.DOWN
            time.sleep(0.02)
    finally:
        peer.send_signal(signal.SIGCONT)
    _wait_link(channel, peer.endpoint, Link.UP, 5.0)


def test_a_killed_peer_goes_gone_at_once(channel, peer):
    _connect(channel, peer)
    peer.kill()
    peer.wait(10)
    took = _wait_link(channel, peer.endpoint, Link.GONE, 5.0)
    assert took < 1.0, f"gone only {took:.2f} s after kill -9"


def test_drain_never_blocks_and_every_message_is_handled_once_in_order():
    """Messages are handled by whichever thread drains first (the channel's
    or a caller's), one at a time: while a handler runs, ``drain()`` returns 0
    at once; whoever handles them, each is handled once, in order."""
    got, entered, gate = [], threading.Event(), threading.Event()

    def handler(msg, origin):
        if msg.seq == 0:
            entered.set()
            gate.wait(10)
        got.append(msg.seq)

    receiver, sender = ZmqChannel(OPTIONS, handler), ZmqChannel(OPTIONS, lambda m, o: None)
    try:
        n = 3000
        for seq in range(n):
            sender.send(receiver.endpoint, PeerPing(session="s", endpoint=sender.endpoint, seq=seq))
        assert entered.wait(10)
        t0 = time.monotonic()
        assert receiver.drain() == 0  # the channel's thread is handling: nothing to wait for
        assert time.monotonic() - t0 < 0.5
        gate.set()
        deadline = time.monotonic() + 20
        while len(got) < n and time.monotonic() < deadline:
            receiver.drain()
            time.sleep(0.0005)
        assert got == list(range(n)), "a message lost, repeated or out of order"
    finally:
        gate.set()
        sender.close()
        receiver.close()
