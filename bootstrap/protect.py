"""Protected mode: nothing of kvferry listens beyond this host unauthenticated
unless told to. Pure (no DNS lookups, no sockets).

The rule: a bootstrap server or rank whose bind address is not a loopback
address needs a shared secret, or an explicit opt-out (``--insecure``,
``insecure=True``, ``KVFERRY_INSECURE=1``). Loopback means 127.0.0.0/8, ::1
(also IPv4-mapped) and the name ``localhost``; anything else, ``0.0.0.0``,
``::``, ``*``, any other name, counts as reachable from elsewhere (a name is
not resolved: what it resolves to may change).
"""

from __future__ import annotations

import ipaddress

from bootstrap.errors import InsecureBindError


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 (bracketed or not, IPv4-mapped too) and ``localhost``."""
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name.lower().rstrip(".") == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def check_protected(host: str, *, has_secret: bool, insecure: bool, what: str, how_insecure: str) -> None:
    """Raise :class:`InsecureBindError` when ``what`` (e.g. "the bootstrap
    server") would bind non-loopback ``host`` with neither a secret nor the
    opt-out; ``how_insecure`` says how to opt out (e.g. "--insecure")."""
    if has_secret or insecure or is_loopback_host(host):
        return
    raise InsecureBindError(
        f"{what} refuses to bind {host!r} without a shared secret: it is not a loopback address, so anyone "
        f"who reaches it could register ranks or aim transfers. Set the same secret on the bootstrap server "
        f"and every rank (KVFERRY_SECRET=..., or --secret-file FILE for the server), or pass {how_insecure} "
        f"to run unauthenticated on a network you trust.")
