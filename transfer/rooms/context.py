"""What the room layer gets from its manager: a typed context, not the manager.

One :class:`RoomContext` per :class:`~transfer.manager.KVManager`, built once
its transport, channel and bootstrap registration info exist; the room
tables, senders, receivers and staging flows of that rank all share it.

Locking: ``lock`` is the rank's one re-entrant lock. Every room's state,
the room tables and the staging flows' bookkeeping change under it;
``changed(room, state)`` must be called with it held, once per change of
a room's state, naming the room (its sender or receiver) and the new state:
it feeds ``KVManager.changed_rooms`` and wakes ``wait_for_progress``
(``changed()`` without a room makes every consumer poll all rooms). Nothing under the lock blocks: transport
``submit`` and channel ``send`` return at once, storage jobs run on the
tier's own thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol
from collections.abc import Callable
from contextlib import AbstractContextManager

from bootstrap.messages import LookupReply, RankInfo
from transfer.config import ManagerConfig
from transfer.stats import RankTotals

if TYPE_CHECKING:
    from transfer.control.base import ControlChannel
    from transfer.staging.area import StagingMemory
    from transfer.storage.tier import StorageTier
    from transfer.transport.base import Transport


class LookupClient(Protocol):
    """The bootstrap server as the decode rooms use it (a
    :class:`bootstrap.client.BootstrapClient`): each call bounded by the
    client's timeout, raising ``BootstrapUnavailable`` (``BootstrapRefused``
    when nothing listens) / ``BootstrapError`` (``UnknownNodeError`` for a
    strict lookup of a node the server does not know)."""

    def lookup(self, node_id: str, dp_rank: int, *, strict: bool = False, partial: bool = False,
               pace: Callable[[], None] | None = None,
               waiting: Callable[[], AbstractContextManager] | None = None) -> LookupReply: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class RoomContext:
    """``config`` and ``rank``: this rank's configuration and registration
    info (session, control endpoint, pools); ``where`` names it in errors.
    ``staging`` is None without staging memory, ``storage`` None without a
    storage tier. ``bootstrap_client(addr)`` opens a client of the bootstrap
    server at ``addr`` (the caller closes it). ``stats``: the rank's running
    totals, which every room's counter adds into (under ``lock``). ``aux``:
    the rank's aux regions as tensors (empty without); with the write fence
    a slot's rows travel in RoomStatus. ``states``: the rank's state pools
    (:class:`~transfer.state_pools.StatePool`, in ``rank.states``' order), for
    the staged path's copies. ``pump()``: move the rank's control
    messages and transfers along on the calling thread (never blocks; called
    by the scheduler-facing ``poll()`` of every room, without the lock held),
    so that a scheduler whose thread is busy in Python needs none of the
    rank's own threads to get the interpreter lock for its rooms to advance."""

    config: ManagerConfig
    where: str
    rank: RankInfo
    lock: threading.RLock
    changed: Callable[..., None]
    transport: Transport
    channel: ControlChannel
    staging: StagingMemory | None
    storage: StorageTier | None
    bootstrap_client: Callable[[str], LookupClient]
    stats: RankTotals = field(default_factory=lambda: RankTotals(""))
    aux: tuple = ()
    pump: Callable[[], None] = lambda: None
    states: tuple = ()


class RoomHost(Protocol):
    """What a room is created with: its rank's
    :class:`~transfer.manager.KVManager` (a sender needs a prefill one, a
    receiver a decode one)."""

    config: ManagerConfig
    context: RoomContext
    rooms: object  # the rank's room table: prefill_table.PrefillRooms or decode_table.DecodeRooms

    @property
    def where(self) -> str: ...

    def check_open(self) -> None:
        """ClosedError once the manager is closed."""
