"""A rank's memory as its transport holds it, for
:class:`~transfer.manager.KVManager`: the scheduler's pools, registered at
start (:func:`register_pools`), released and resumed by the scheduler
(:class:`MemoryRelease`: SGLang's ``release_memory_occupation`` /
``resume_memory_occupation``, between weight updates in RL loops), and a
fenced decode rank's staging arenas, registered as they open and retire
(:class:`ArenaRegistration`).

The release's rule: the pools' memory may be freed only once no write of this rank
still reads it and no peer's write may still land in it. A release fails
every live room (its peers are told, as for an abort), waits until each room
says its writes ended (a decode room only once its prefill ranks stopped
writing), then unregisters the pools from the transport, so that a peer's
later write into them is refused. No room starts until the resume registers
them again, at the same addresses.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

from bootstrap.errors import KVTimeoutError
from transfer.errors import ClosedError, MemoryReleasedError
from transfer.pools import MHAPool, MLAPool, registration_regions, unique_regions
from transfer.state_pools import StatePool, state_regions

if TYPE_CHECKING:
    from transfer.rooms.context import RoomContext
    from transfer.staging.area import StagingMemory
    from transfer.transport.base import Transport

log = logging.getLogger("kvferry.manager")


def register_pools(transport: Transport, pools: Sequence[MHAPool | MLAPool], aux: tuple,
                   states: tuple[StatePool, ...], staging: StagingMemory | None) -> list[tuple[int, int]]:
    """Register the scheduler's memory (pools, aux, state pools) and the
    staging tensor with ``transport``, on the manager's constructor; returns
    the scheduler's regions, what a release takes back. A fenced decode rank
    registers nothing here and returns none: its peers write only into
    kvferry's staging arenas, registered as they open. Raises
    TransferError when the engine refuses."""
    if staging is not None and staging.fenced:
        return []
    regions = registration_regions(pools, aux)  # views of one allocation: registered once
    regions = unique_regions(regions + state_regions(states))  # states may view the pools' memory
    pool_regions = list(regions)
    if staging is not None:
        regions.append((staging.tensor.data_ptr(), staging.tensor.numel()))
    transport.register(regions)
    return pool_regions


class ArenaRegistration:
    """A fenced decode rank's staging arenas with its transport:
    :meth:`register` and :meth:`unregister` are the staging's callbacks
    (:func:`~transfer.staging.build.build_staging`), called as an arena opens
    or is replaced (on the manager's constructor, then under the rank's
    lock). A transport whose peers hold its metadata (NIXL) tells them of
    every change at once, before any grant names the new arena (see
    PeerHello), through the room table's links (``rooms()``: None while the
    manager is being built, when nothing is told). Raises what the
    transport raises (TransferError)."""

    def __init__(self, transport: Transport, rooms: Callable[[], Any]) -> None:
        self._transport, self._rooms = transport, rooms

    def register(self, regions: list[tuple[int, int]]) -> None:
        self._transport.register(regions)
        self._memory_changed()

    def unregister(self, regions: list[tuple[int, int]]) -> None:
        self._transport.unregister(regions)
        self._memory_changed()

    def _memory_changed(self) -> None:
        rooms = self._rooms()
        if rooms is not None and self._transport.peer_metadata is not None:
            rooms.links.announce()


class MemoryRelease:
    """One rank's release and resume of ``pool_regions`` (what
    :func:`register_pools` returned), over ``rooms`` (the rank's room table)
    and the rank's ``context`` (its lock, transport, ``pump`` and
    ``config.transfer_timeout_s``); ``closed()`` says whether the manager is
    closed (read under the lock).

    Threads: :meth:`release` on a scheduler's thread (it blocks, pumping the
    rank's work along, for at most its bound); :meth:`resume`, :meth:`check`
    and :attr:`released` from any thread. The state changes under the rank's
    lock, which is never held while waiting. A transport's refusal to
    unregister or register the pools raises its TransferError."""

    def __init__(self, context: RoomContext, rooms, pool_regions: list[tuple[int, int]],
                 closed: Callable[[], bool]) -> None:
        self._ctx, self._rooms, self._pool_regions, self._closed = context, rooms, pool_regions, closed
        #: release() ran, resume() not yet
        self.released = False
        self._pools_unregistered = False  # release() took the pools back from the transport

    def check(self) -> None:
        """MemoryReleasedError between :meth:`release` and :meth:`resume` (no room may start)."""
        if self.released:
            raise MemoryReleasedError(f"{self._ctx.where}: the KV memory is released (release_memory); "
                                      "no room starts before resume_memory()")

    def release(self, timeout_s: float | None = None) -> None:
        """Every live room fails with :class:`MemoryReleasedError` (and its
        peers are told, as for an abort), then this waits until no write of
        this rank still reads the pools and no peer's write may still land in
        them (decode rooms report Failed only after their prefill ranks
        stopped writing), at most ``timeout_s`` (default
        ``transfer_timeout_s``), and unregisters the pools from the transport:
        a peer's later write into them is refused. No room starts until
        :meth:`resume`. Raises ClosedError once the manager is closed, and
        KVTimeoutError when writes are still in flight at the bound: the
        memory must not be freed then (calling it again waits again). Returns
        at once when already done."""
        ctx = self._ctx
        where = ctx.where
        bound = ctx.config.transfer_timeout_s if timeout_s is None else timeout_s
        with ctx.lock:
            if self._closed():
                raise ClosedError(f"{where}: manager is closed")
            first, self.released = not self.released, True
            rooms = self._rooms.live_rooms()
        if first:
            error = MemoryReleasedError(f"{where}: the scheduler released the KV memory (release_memory)")
            for room in rooms:
                room.release(error)
        deadline = time.monotonic() + bound
        busy = rooms
        while busy:
            ctx.pump()
            busy = [room for room in busy if not room.released()]
            if busy and time.monotonic() > deadline:
                raise KVTimeoutError(f"{where}: {len(busy)} room(s) still had writes in flight {bound:g} s "
                                     f"after release_memory(): {busy[0].where}: {busy[0].progress()}")
            if busy:
                time.sleep(0.005)
        with ctx.lock:
            if self._pool_regions and not self._pools_unregistered:
                ctx.transport.unregister(self._pool_regions)
                self._pools_unregistered = True
        log.info("%s: KV memory released (%d room(s) failed)", where, len(rooms))

    def resume(self) -> None:
        """The scheduler has the pools' memory back, at the same addresses:
        register the pools again and take rooms again. Idempotent; nothing
        once the manager is closed."""
        ctx = self._ctx
        with ctx.lock:
            if self._closed() or not self.released:
                return
            if self._pools_unregistered:
                ctx.transport.register(self._pool_regions)
                self._pools_unregistered = False
            self.released = False
        log.info("%s: KV memory resumed", ctx.where)
