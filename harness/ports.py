"""Loopback ports for servers the tests and benchmarks start.

A port chosen here is bound seconds later by another process (a vLLM or
SGLang server, a bootstrap server, ``mooncake_master``). Meanwhile the
kernel may give the same number to anyone asking for an ephemeral port:
every outgoing connection's source port, every ``bind(0)`` (vLLM's
internal ports, ZMQ's), and it offers a just-released port again at once
(a vLLM test's NIXL side channel found its port taken so). So ports come from a band the kernel never hands out by itself
(below ``ip_local_port_range``) and that Mooncake's engines do not pick
from either (their RPC and TCP listeners take random ports in 15000-17000),
each checked free when chosen and never handed out twice by one process.
A process walks the band upwards from a random start (as the kernel walks
its own range), so two processes (pytest's workers) name the same port
only where their walks meet, not at any pick; it leaves :data:`GAP` ports
after each block it hands out, for servers that take their port plus a
small offset (one per TP rank, say).
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator

BAND = (20000, 32768)  # [low, high): below Linux's default ephemeral range, above Mooncake's 15000-17000
GAP = 15  # ports left unnamed after each block handed out
_GIVEN: set[int] = set()  # ports handed out by this process
_next: list[int] = []  # where this process's walk goes on (empty: not started)


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high + 1
    except (OSError, ValueError):
        return 32768, 61000


def _band() -> range:
    """The band, cut below the ephemeral range where a machine's starts inside it."""
    low, high = BAND
    eph_low, _ = _ephemeral()
    if low + 1000 <= eph_low < high:
        high = eph_low
    return range(low, high)


def _bindable(ports: range) -> bool:
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive ports, each free on loopback now,
    outside the kernel's ephemeral range, and not handed out before by
    this process."""
    band = _band()
    if not _next:
        _next.append(random.randrange(band.start, band.stop))
    for _ in range(len(band)):
        base = _next[0] if _next[0] + count <= band.stop else band.start
        ports = range(base, base + count)
        _next[0] = base + 1
        if _GIVEN.isdisjoint(ports) and _bindable(ports):
            _GIVEN.update(ports)
            _next[0] = base + count + GAP
            return base
    raise RuntimeError(f"no {count} consecutive free loopback ports in {band.start}-{band.stop - 1}")


def free_port() -> int:
    """One port, as :func:`free_ports`."""
    return free_ports(1)


@contextlib.contextmanager
def refusing_address() -> Iterator[str]:
    """``127.0.0.1:PORT`` where every connection is refused for as long as
    the block runs. A closed port does not stay so: any process binding an
    ephemeral port (a kvferry rank's control channel, a NIXL listener) may
    get it at once, and a test running beside found it answered so. Here a
    socket bound without ``SO_REUSEADDR`` and never listening holds it: a
    connect gets a reset (refused), and no other socket can bind it."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{holder.getsockname()[1]}"
    finally:
        holder.close()
