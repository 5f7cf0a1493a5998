"""The control plane's interface: one-way, self-describing messages between ranks.

A :class:`ControlChannel` is bound at construction to ``endpoint`` (what
peers pass to ``send``) and delivers every message that arrives, decoded
with :mod:`bootstrap.codec` (sealed and verified with the shared secret when
there is one), to the handler it was built with, as ``handler(msg,
origin)``: ``origin`` is the network address (host, no port) the message
came from as the transport saw it (zmq: the TCP peer address), or "" when
the channel cannot tell. A message says who sent it; ``origin`` is what a
receiver may check that claim against. Implementations: zmq
(:mod:`transfer.control.zmq_channel`) and an in-process one for unit tests
(:mod:`transfer.control.loopback`).

The contract every implementation keeps:

- The handler runs on the channel's one receiving thread, one message at a
  time, in the order a peer sent them; an exception it raises is logged and
  the channel goes on. A malformed message (``num_malformed``) or one that
  fails authentication (``num_unauthenticated``) is counted and dropped;
  ``num_received`` counts every message that arrived, good or not.
- ``send(endpoint, msg)`` never blocks and is thread-safe. It raises
  :class:`~transfer.errors.ClosedError` after ``close()`` and
  :class:`~transfer.errors.TransferError` when the queue to that peer is
  full; a peer that is not there is not an error (the message waits or is
  lost, as on a network).
- ``forget(endpoint)`` drops what is queued for a peer taken for dead; a
  later ``send`` reaches it afresh.
- ``close()`` stops the receiving thread within a bounded time. Idempotent.

A :class:`KVManager <transfer.manager.KVManager>` builds its channel through a
:data:`ChannelFactory`, ``factory(host, handler, secret)``, because the
handler is the manager's own.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

#: ``handler(msg, origin)``; see the module docstring.
Handler = Callable[[Any, str], None]


class ControlChannel(Protocol):
    endpoint: str
    num_received: int
    num_malformed: int
    num_unauthenticated: int

    def send(self, endpoint: str, msg) -> None: ...

    def forget(self, endpoint: str) -> None: ...

    def close(self) -> None: ...


#: ``factory(host, handler, secret)``: a channel bound on ``host`` (the
#: address peers reach this rank at) that hands messages to ``handler``;
#: ``secret`` is None when messages are not sealed.
ChannelFactory = Callable[[str, Handler, "str | None"], ControlChannel]
