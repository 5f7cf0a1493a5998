"""An HTTP request sent to a port by hand, as a router or a health check
would send it, with what came back and how the exchange ended: the tests'
check that a port which does not speak HTTP fails such a request at once
instead of leaving it hanging."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

# Shorter than the 71 bytes libzmq waits for after the ``G`` of ``GET``.
SHORT_GET = b"GET /query HTTP/1.1\r\nHost: h\r\n\r\n"
# A curl-like request, longer than that.
CURL_GET = (b"GET /query HTTP/1.1\r\nHost: 127.0.0.1:8998\r\nUser-Agent: curl/8.5.0\r\n"
            b"Accept: */*\r\n\r\n")


@dataclass(frozen=True)
class HttpAttempt:
    """``ended`` is ``"closed"`` (the server closed), ``"reset"`` or
    ``"timeout"`` (nothing ended it within the probe's bound)."""

    received: bytes
    ended: str
    seconds: float


def send_http(host: str, port: int, request: bytes, timeout_s: float = 10.0) -> HttpAttempt:
    """Send ``request`` and read until the server ends the exchange or ``timeout_s`` passes."""
    t0 = time.monotonic()
    received, ended = b"", "timeout"
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(request)
        try:
            while chunk := sock.recv(4096):
                received += chunk
            ended = "closed"
        except ConnectionResetError:
            ended = "reset"
        except TimeoutError:
            ended = "timeout"
    return HttpAttempt(received, ended, time.monotonic() - t0)
