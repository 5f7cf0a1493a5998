"""A DEALER's connection as its socket monitor's events tell it (see
:class:`transfer.control.base.Link`); :mod:`transfer.control.zmq_channel`
watches each DEALER with :data:`MONITORED`. Pure: the events are libzmq's
monitor event bits (``ZMQ_EVENT_*`` of ``zmq.h``, part of its stable ABI;
tests/unit/test_zmq_links.py checks them against pyzmq's)."""

from __future__ import annotations

from transfer.control.base import Link

_UP = 0x1000  # ZMQ_EVENT_HANDSHAKE_SUCCEEDED
# DISCONNECTED, CLOSED, HANDSHAKE_FAILED_NO_DETAIL, _PROTOCOL, _AUTH
_DOWN = 0x0200 | 0x0080 | 0x0800 | 0x2000 | 0x4000
# A reconnection scheduled: once after a connection is lost, then once after every attempt that failed.
_RETRY = 0x0004  # ZMQ_EVENT_CONNECT_RETRIED
_CONNECTED = 0x0001  # ZMQ_EVENT_CONNECTED: TCP connected (a stopped process's kernel still accepts)
#: the events each DEALER's monitor reports
MONITORED = _UP | _DOWN | _RETRY | _CONNECTED


class LinkState:
    """One DEALER's connection as its monitor's events tell it."""

    __slots__ = ("link", "retries")

    def __init__(self) -> None:
        self.link, self.retries = Link.UNKNOWN, 0

    def on_event(self, event: int) -> None:
        if event & _UP:
            self.link, self.retries = Link.UP, 0
        elif event & _CONNECTED:
            self.retries = 0
        elif event & _RETRY:
            self.retries += 1
            # The first retry follows the loss itself; a second with no TCP connection between
            # means an attempt failed: once up, a refused address (the process there is gone).
            if self.retries >= 2 and self.link is not Link.UNKNOWN:
                self.link = Link.GONE
            elif self.link is Link.UP:
                self.link = Link.DOWN
        elif event & _DOWN and self.link is Link.UP:
            self.link = Link.DOWN
