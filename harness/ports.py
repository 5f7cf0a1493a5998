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
"""

from __future__ import annotations

import random
import socket

BAND = (20000, 32768)  # [low, high): below Linux's default ephemeral range, above Mooncake's 15000-17000
_GIVEN: set[int] = set()  # ports handed out by this process
_rng = random.Random()


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
    for _ in range(1000):
        base = _rng.randrange(band.start, band.stop - count + 1)
        ports = range(base, base + count)
        if _GIVEN.isdisjoint(ports) and _bindable(ports):
            _GIVEN.update(ports)
            return base
    raise RuntimeError(f"no {count} consecutive free loopback ports in {band.start}-{band.stop - 1}")


def free_port() -> int:
    """One port, as :func:`free_ports`."""
    return free_ports(1)
