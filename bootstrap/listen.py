"""A listening ZMQ socket that refuses what does not speak ZMTP 3.

libzmq treats a first byte other than ``0xff`` as a ZMTP 1.0 peer and
reads it as a frame length: an HTTP client's ``G`` (of ``GET /query``, what
Mooncake routers ask a bootstrap port) waits for 71 bytes, and a request
shorter than that then waits forever, on both sides, past
``ZMQ_HANDSHAKE_IVL``. With a ZAP domain set, libzmq refuses ZMTP 1.0 at
its first byte and resets the connection: the HTTP client fails at once
("connection reset by peer"), where it would hang. No ZAP handler runs
(none is bound in our contexts, and the domain is not enforced), so
ZMTP 3 peers, every kvferry client, connect as before.
"""

from __future__ import annotations

import zmq

# Set on every listening socket; a name in libzmq's logs, never checked.
ZAP_DOMAIN = b"kvferry"


def refuse_unversioned(sock: zmq.Socket) -> None:
    """Make ``sock`` (before ``bind``) reset non-ZMTP-3 connections at once."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
