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
- ``submit(peer, plan, callback, ready=None)`` returns at once, from any
  thread. An empty plan calls ``callback(None)`` before returning and returns
  None; otherwise it returns a :class:`TransferHandle`. ``ready`` (a
  :class:`~transfer.ready.ReadyGate`, or None): no byte of the plan is read
  before ``ready.done()``; the worker polls it, never the caller's thread,
  and a gate past its deadline fails the plan with a TransferError. Callers
  pass ``ready`` only when they have one (older transports lack it). After ``close()`` it raises
  :class:`~transfer.errors.ClosedError`.
- ``callback(error)`` runs exactly once per non-empty plan, on the
  transport's worker thread, after every descriptor it submitted finished
  or failed (so the source memory may be reused when it runs): ``None`` on
  success, a :class:`~transfer.errors.TransferError` naming the peer
  otherwise. It must be quick and must not call back into the transport's
  blocking methods; an exception it raises is logged, and the worker goes on.
- ``handle.cancel()`` submits no more of the plan's descriptors (those
  already submitted run to their end); the callback then gets a
  TransferError.
- ``close()`` fails the outstanding plans (their callbacks get a
  TransferError), stops the worker within a bounded time and unregisters
  memory. Idempotent.
- ``session`` names this transport to peers (what they pass as ``peer``);
  ``num_bytes`` and ``num_descriptors`` count what completed successfully.
"""

from __future__ import annotations

from typing import Callable, Protocol

from transfer.errors import TransferError
from transfer.plan import TransferPlan

DoneCallback = Callable[[TransferError | None], None]


class TransferHandle(Protocol):
    def cancel(self) -> None:
        """Submit no more of this plan's descriptors."""


class Transport(Protocol):
    session: str
    num_bytes: int
    num_descriptors: int

    def register(self, regions: list[tuple[int, int]]) -> None: ...

    def unregister(self, regions: list[tuple[int, int]]) -> None: ...

    def submit(self, peer: str, plan: TransferPlan, callback: DoneCallback,
               ready=None) -> TransferHandle | None: ...

    def close(self) -> None: ...
