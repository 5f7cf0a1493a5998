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
  lost, as on a network). ``msg`` may be a :class:`Packed` message (encoded
  once, sealed afresh by each send).
- ``connect(endpoint)`` opens what the first ``send`` to ``endpoint`` would
  open (nothing when it is open), without holding what ``send`` holds
  meanwhile: a thread about to talk to a new peer opens it first, off its
  own locks, so that neither its locks nor other senders wait on a socket
  being made. Thread-safe, never blocks; ClosedError after ``close()``.
- ``drain()`` hands every message that arrived to the handler now, on the
  caller's thread, and returns how many (0 at once when another thread is
  handling messages: they are being handled). It never blocks; handlers run
  one at a time and in order whichever thread runs them. A scheduler whose
  thread is busy makes progress this way without waiting for the channel's
  thread to get the interpreter lock.
- ``settle(timeout_s)`` hands every message that has arrived to the
  handler before it returns: it waits up to ``timeout_s`` for a drain in
  progress on another thread, then drains what is left. A rank calls it
  before it gives up on a peer found gone, so that what the peer said
  before it went (a completion queued behind a busy scheduler) counts.
- ``link(endpoint)``: the connection to a peer this channel sends to, as
  the transport itself sees it, with no Python thread of either process
  involved (a :class:`Link`). zmq: ``UP`` once its ZMTP handshake succeeded
  while its heartbeats are answered (by libzmq's I/O threads), so a peer
  whose process is alive but whose Python threads are starved stays ``UP``;
  a stopped one goes ``DOWN`` within ``peer_timeout_s / 2``; a killed one
  goes ``DOWN`` at once and ``GONE`` once its address refused a reconnection.
- ``close()`` stops the receiving thread within a bounded time. Idempotent.

A :class:`KVManager <transfer.manager.KVManager>` builds its channel through a
:data:`ChannelFactory`, ``factory(options, handler)``, because the handler is
the manager's own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol
from collections.abc import Callable

from bootstrap import codec
from transfer.round_times import RoundTimes

#: ``handler(msg, origin)``; see the module docstring.
Handler = Callable[[Any, str], None]


class Link(enum.Enum):
    """A channel's connection to one peer (see ``link`` in the module docstring)."""

    #: nothing sent there yet, or the first connection not made yet
    UNKNOWN = "unknown"
    #: connected, and the peer's end answers the connection's heartbeats
    UP = "up"
    #: no connection now: the peer stopped, or the network is down, or it is on its way back
    DOWN = "down"
    #: it was up, and its address now refuses connections: the process there is gone
    GONE = "gone"


@dataclass(frozen=True)
class Packed:
    """A message encoded once (:func:`bootstrap.codec.pack`) for a sender
    that sends it often, or that encodes it off a lock it sends under (a
    decode rank's hello carries every buffer of its pools: packing a large
    model's takes up to half a millisecond). ``send`` seals ``payload``
    afresh each time: a sealed frame carries the time it was sealed."""

    msg: Any
    payload: bytes

    @classmethod
    def of(cls, msg: Any) -> Packed:
        return cls(msg, codec.pack(msg))


def frame(msg: Any, key: bytes | None) -> bytes:
    """``msg`` as ``send`` puts it on the wire: encoded and sealed with
    ``key`` (see :func:`bootstrap.codec.secret_key`), or, a :class:`Packed`
    message, only sealed."""
    return codec.seal(msg.payload, key) if isinstance(msg, Packed) else codec.encode(msg, key)


@dataclass(frozen=True, kw_only=True)
class ChannelOptions:
    """``host``: the address peers reach this rank at (the channel binds
    there); ``secret``: seals every message (None: off); the connection
    heartbeats of ``link``: every ``heartbeat_interval_s``, a peer
    unanswered for ``peer_timeout_s / 2`` is down."""

    host: str
    secret: str | None = None
    heartbeat_interval_s: float = 0.5
    peer_timeout_s: float = 4.0


class ControlChannel(Protocol):
    endpoint: str
    num_received: int
    num_malformed: int
    num_unauthenticated: int
    #: where the channel's own thread counts its idle rounds (``control``): its own
    #: :class:`transfer.round_times.RoundTimes` until its owner sets the rank's
    round_times: RoundTimes

    def send(self, endpoint: str, msg) -> None: ...

    def connect(self, endpoint: str, between: Callable[[], None] | None = None) -> None: ...

    def drain(self) -> int: ...

    def settle(self, timeout_s: float) -> int: ...

    def link(self, endpoint: str) -> Link: ...

    def close(self) -> None: ...


#: ``factory(options, handler)``: a channel bound on ``options.host`` that
#: hands messages to ``handler``.
ChannelFactory = Callable[[ChannelOptions, Handler], ControlChannel]
