"""This machine's address as its peers see it, for the adapters' defaults."""

from __future__ import annotations

import socket

#: a destination with no host behind it on most networks: connecting to it picks the default route
DEFAULT_ROUTE = "10.255.255.255"


def outgoing_address(towards: str = DEFAULT_ROUTE) -> str:
    """The address this machine sends from towards ``towards`` (a UDP
    socket's ``connect`` picks the outgoing interface; no packet is sent);
    ``127.0.0.1`` when there is no route or the name does not resolve."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in towards else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((towards, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
