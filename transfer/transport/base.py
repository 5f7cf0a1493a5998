"""The data path's interface: what the room layer needs of a transfer engine.

A :class:`Transport` moves the entries of a :class:`~transfer.plan.TransferPlan`
(``src_addr -> dst_addr, nbytes``) from this process's memory into memory a
peer registered with its own transport. Implementations: the Mooncake
engine (:mod:`transfer.transport.mooncake`) and an in-process memcpy for unit
tests (:mod:`transfer.transport.loopback`).

The contract every implementation keeps:

- ``register(regions)`` is called once, before any peer learns the
  session; it makes ``(addr, nbytes)`` regions writable by peers. It raises
  :class:`~transfer.errors.TransferError` when the engine refuses.
- ``unregister(regions)`` takes back regions given to ``register``
  (matched by address); from then on peers' new writes into them are
  refused. A write the engine accepted before may still land (Mooncake's
  TCP transport validates a write request once, at its start): callers must
  never reuse such memory for anything read. Raises TransferError when the
  engine refuses.
- ``open_peer(peer, blob, callback)`` opens the way to ``peer`` before any
  plan goes there (``blob``: what the peer's handshake carried,
  ``PeerHello.transport_meta``; again when the peer's memory changed). It
  checks the blob at once (ProtocolError for a malformed one,
  IncompatibleTransportError for one this side cannot use) and returns at
  once: the engine's part (Mooncake: the segment lookup and a probe write;
  NIXL: loading the peer agent's metadata) runs on the transport's
  ``kvferry-open-call`` thread, bounded by ``handshake_timeout_s``
  (:mod:`transfer.transport.opener`). ``callback(None)`` once the peer is
  open, ``callback(HandshakeError)`` when it could not be, on the opener
  thread (at once when it was open already). A plan to a peer that is not
  open waits for it (and asks for its open, with no blob, if none was
  asked), and fails with that HandshakeError: no plan's first write runs
  the engine's handshake, and no caller's thread waits for one.
- ``submit(peer, plan, callback, ready, priority=0.0)`` returns at once, from any
  thread. An empty plan calls ``callback(None)`` before returning and returns
  None; otherwise it returns a :class:`TransferHandle`. ``ready`` (a
  :class:`~transfer.ready.ReadyGate`, or None): no byte of the plan is read
  before ``ready.done()``; the worker polls it, never the caller's thread,
  and a gate past its deadline fails the plan with a TransferError. After
  ``close()`` it raises :class:`~transfer.errors.ClosedError`.
  ``priority``: of the plans to one peer that wait for the link, lower goes
  first (equal ones in the order submitted); the room layer passes the
  room's creation time, so that a saturated link finishes rooms oldest first
  (staged parts pass 0: they hold staging on both sides). Mooncake hands
  its engine at most ``EngineConfig.inflight_bytes_per_peer`` per peer and
  keeps the rest in that order; NIXL and the loopback ignore it.
- ``callback(error)`` runs exactly once per non-empty plan, on a thread of
  the transport's (its worker; the opener, for a plan whose peer could not
  be opened) or in ``pump()``, after every descriptor it submitted finished
  or failed (so the source memory may be reused when it runs): ``None`` on
  success, a :class:`~transfer.errors.TransferError` naming the peer
  otherwise. It must be quick and must not call back into the transport's
  blocking methods; an exception it raises is logged, and the worker goes on.
- ``handle.cancel()`` submits no more of the plan's descriptors (those
  already submitted run to their end); the callback then gets a
  TransferError.
- ``pump()`` moves the transport's work along now, on the caller's thread
  (submits what is queued, checks what is in flight, runs the callbacks of
  plans that ended), and returns at once when there is nothing to do or
  another thread is at it: it never blocks (while a peer open holds the
  engine's lock it submits nothing). A busy scheduler's poll calls it,
  so that its transfers move without another thread getting the
  interpreter lock. A transport may do nothing here (its own thread does it all).
- ``close()`` fails the outstanding plans (their callbacks get a
  TransferError), stops the worker within a bounded time and unregisters
  memory. Idempotent.
- ``session`` names this transport to peers (what they pass as ``peer``);
  ``kind`` names its engine (``mooncake``, ``nixl``: what
  ``RankInfo.transport`` says, and both sides of a room must agree on);
  ``describe()`` says in words what is in use (one log line per manager; a
  line that says "falls back" is logged as a warning); ``num_bytes`` and
  ``num_descriptors`` count what completed successfully.
- ``describe_job(handle)`` says in words where a plan ``submit`` took
  stands (queued, waiting for its ready event, descriptors submitted and
  still in the engine, ended) and whether the worker is stuck in an engine
  call: what a failure's message needs to tell a hung engine from a lost
  message. It never blocks.
- ``peer_metadata``: a :class:`PeerMetadata`, this side's part of kvferry's
  handshake (Mooncake: its metadata mode, relayed segment and probe region;
  NIXL: its agent's metadata), or None for an engine that needs none.
- ``handshake_counts()``: the opener's counters (``handshakes``,
  ``handshake_failures``, ``handshake_timeouts``, ``handshake_seconds``,
  ``handshakes_in_progress``), for the rank's stats and ``/metrics``.

Every transport passes the conformance suite ``tests/transport/test_conformance.py``.
"""

from __future__ import annotations

from typing import Protocol
from collections.abc import Callable

from transfer.errors import TransferError
from transfer.plan import TransferPlan

DoneCallback = Callable[[TransferError | None], None]


class TransferHandle(Protocol):
    def cancel(self) -> None:
        """Submit no more of this plan's descriptors."""


class PeerMetadata(Protocol):
    """What a transport needs carried between peers before one can write into
    the other: a decode rank's :meth:`metadata` travels in its handshake
    (``PeerHello.transport_meta``) and is given to the prefill rank's
    ``Transport.open_peer``; again whenever the decode rank's registered
    memory changed (a fenced rank's arenas), before any grant names new
    memory."""

    def metadata(self) -> bytes:
        """This transport's metadata now (its registered memory included);
        never blocks."""


class Transport(Protocol):
    kind: str
    session: str
    num_bytes: int
    num_descriptors: int
    peer_metadata: PeerMetadata | None

    def describe(self) -> str: ...

    def describe_job(self, handle: TransferHandle) -> str: ...

    def register(self, regions: list[tuple[int, int]]) -> None: ...

    def unregister(self, regions: list[tuple[int, int]]) -> None: ...

    def open_peer(self, peer: str, blob: bytes,
                  callback: Callable[[TransferError | None], None] | None = None) -> None: ...

    def handshake_counts(self) -> dict[str, float]: ...

    def submit(self, peer: str, plan: TransferPlan, callback: DoneCallback, ready,
               priority: float = 0.0) -> TransferHandle | None: ...

    def pump(self) -> None: ...

    def close(self) -> None: ...
