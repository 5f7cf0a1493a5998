"""Prefill side: who may be a decode peer. The rule, checked on every
PeerHello before its layouts are:

1. The declared transfer session is not this rank's own.
2. It is not the session of another prefill rank of this node as the
   bootstrap server lists it (refreshed with every re-registration), so a
   peer cannot aim this rank's writes at a sibling's memory.
3. Its host is the host the hello came from (the control channel's
   ``origin``, zmq's TCP peer address): a peer cannot name another
   machine's engine as its own. A host name in the session is resolved
   (cached); with ``ManagerConfig.check_peer_host`` False (hosts whose
   control traffic leaves from another address than their engine's) this
   check is off, and rules 1-2 still hold.

A TransferRequest or a RoomAbort is then taken only from a handshaken
session, at the endpoint it handshook with, from the same origin.

What this does not cover, and what covers it: a peer on the same host
naming another local process's session passes rule 3; its writes still
land only inside memory that process registered with its engine (Mooncake's
TCP transport checks every write against the target's registered buffers
on the target side, and the loopback transport does the same; NIXL's
writer checks against the regions the peer announced, see
:mod:`transfer.transport.nixl.peers`), and within
the pools the peer declared (:func:`transfer.plan.check_transfer`).
Authentication (``KVFERRY_SECRET``) is what keeps strangers out altogether.
"""

from __future__ import annotations

import functools
import ipaddress
import socket


def session_host(session: str) -> str:
    """The host part of a transfer session ``host:port`` (``[v6]:port`` too)."""
    return session.rpartition(":")[0].strip("[]")


def _ip(text: str):
    try:
        addr = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


@functools.lru_cache(maxsize=1024)
def _addresses(host: str) -> frozenset:
    """The addresses ``host`` stands for (itself if it is one; resolved
    otherwise, cached; none if it does not resolve)."""
    ip = _ip(host)
    if ip is not None:
        return frozenset({ip})
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return frozenset()
    return frozenset(a for a in (_ip(info[4][0]) for info in infos) if a is not None)


def same_host(session: str, origin: str) -> bool:
    """Whether the session's host is ``origin`` (an address)."""
    origin_ip = _ip(origin)
    if origin_ip is None:
        return session_host(session) == origin
    return origin_ip in _addresses(session_host(session))


def identity_problem(session: str, origin: str, *, own_session: str, prefill_sessions,
                     check_host: bool) -> str:
    """Why a decode peer declaring ``session`` in a hello from ``origin`` is
    refused ("" if it is not): rules 1-3 of the module docstring."""
    if session == own_session:
        return f"declares this prefill rank's own transfer session {session}"
    if session in prefill_sessions:
        return f"declares the transfer session {session} of another prefill rank of this node"
    if check_host and origin and not same_host(session, origin):
        return f"declares transfer session {session}, but its message came from {origin}"
    return ""
