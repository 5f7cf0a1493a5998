"""The staged path's message flow on decode (prefill's is
:mod:`transfer.rooms.staged_prefill`).

A StageRequest gets a region of the staging buffer; when it is full the
requests wait, the oldest room's first (the receiver's creation time, then
the order they came in: a batch whose rooms stream layer groups finishes
its rooms one after another, not all together at its end). A part's
landing (a :class:`~transfer.messages.ChunkStaged` of its kind: pages, a
layer share, state items) scatters the region into the request's pages or
items and frees it. A fenced rank
grants a room's whole region with its request instead, when it fits
(:meth:`DecodeStaging.pregrant`): the room's parts land in it without
asking, and it is freed when the room ends. Regions granted with requests
hold at most half the staging (``PREGRANT_SHARE``): a request can come long
before prefill computes its room (behind a full prefill scheduler), and the
rooms prefill did compute must still find room to ask for, or both
schedulers wait on each other until the transfer timeout. A layer-wise send's
``ShareStaged`` names a layer group: only those layers of the part
are scattered, from their places in the part's slot of the room's region,
or packed one after the other in a region of their own (then freed as any
part's).
A part's landing and the final RoomStatus travel on the same ordered channel, so
decode has scattered every part before it reports Success.

A region granted to a room that then fails is freed only after
``quarantine_s``: a write still in flight to it would otherwise land in a
region handed to someone else. With the write fence (fenced staging: a
:class:`~transfer.staging.arenas.StagingArenas`) there is no quarantine: a
room whose prefill ranks confirmed they stopped writing frees its regions at
once; one with a lost writer poisons them (their arena is retired).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Protocol
from collections.abc import Callable

import numpy as np

from bootstrap.messages import RankInfo
from transfer.errors import KVFerryError
from transfer.messages import (ChunkStaged, PagesStaged, PoolAssignment, ShareStaged, StageGrant, StageRequest,
                               StateStaged)
from transfer.plan import page_slice, staged_bytes
from transfer.rooms.chunk_plan import state_blocks
from transfer.rooms.context import RoomContext
from transfer.rooms.layer_groups import by_pool, layer_spans, num_layers
from transfer.staging.copies import page_tensor, scatter, scatter_state, write_aux_row
from transfer.state_pools import state_rows

log = logging.getLogger("kvferry.staging")

#: the share of the staging that regions granted with requests may hold together
PREGRANT_SHARE = 0.5


@dataclass(frozen=True)
class ScatterTarget:
    """Where a staged part lands, from its room (:meth:`StagedReceiver.begin_scatter`)."""

    pages: np.ndarray  # the request's decode pages, in request order
    routes: tuple[PoolAssignment, ...]  # what the part's prefill rank sends
    states: tuple  # the room's state item indices, per state pool (None: none)
    rank: RankInfo  # the part's prefill rank


class StagedReceiver(Protocol):
    """What the flow needs of the room a part lands for (a
    :class:`~transfer.rooms.receiver.KVReceiver`); called under ``ctx.lock``."""

    @property
    def where(self) -> str: ...

    def begin_scatter(self, msg: ChunkStaged) -> ScatterTarget | None:
        """Where the part goes, once the room counts a scatter in progress
        (it cannot end before :meth:`end_scatter`); None when it takes no
        more parts."""

    def end_scatter(self, msg: ChunkStaged, error: BaseException | None) -> None:
        """The scatter :meth:`begin_scatter` allowed ended (``error``: it failed)."""


class DecodeStaging:
    """Grants staging regions to prefill ranks and scatters what lands."""

    def __init__(self, ctx: RoomContext, created: Callable[[int, int], float | None], quarantine_s: float) -> None:
        """``created(room, request_id)``: when the room's live receiver was
        made (None: the room has none now; called under ``ctx.lock``)."""
        self.ctx = ctx
        self.created = created
        self.quarantine_s = quarantine_s
        # waiting requests: (their room's creation time, arrival number, request), a heap: oldest room first
        self._queue: list[tuple[float, int, StageRequest]] = []
        self._arrivals = itertools.count()
        # (room, request id) -> (prefill TP rank, part) -> (offset, nbytes): a part's region
        self._granted: dict[tuple[int, int], dict[tuple[int, int], tuple[int, int]]] = {}
        # (room, request id) -> prefill TP rank -> (offset, nbytes): a room's region granted with its request
        self._pregranted: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        self._pregranted_bytes = 0
        self._quarantine: list[tuple[float, int, int]] = []

    def pregrant(self, room: int, request_id: int, tp_rank: int, nbytes: int) -> int:
        """A region of ``nbytes`` for everything prefill rank ``tp_rank``
        sends of a room, granted with its request: its offset, or -1 when
        the staging has no room for it (or it is larger than a region can
        be, or the regions granted with requests would hold more than
        ``PREGRANT_SHARE`` of it; its parts then ask one by one). Under
        ``ctx.lock``."""
        area = self.ctx.staging.area
        if not 0 < nbytes <= area.max_region_bytes or self._queue:  # waiting requests go first
            return -1
        if self._pregranted_bytes + nbytes > PREGRANT_SHARE * area.nbytes:
            return -1
        offset = area.alloc(nbytes)
        if offset is None:
            return -1
        self._pregranted.setdefault((room, request_id), {})[tp_rank] = (offset, nbytes)
        self._pregranted_bytes += nbytes
        return offset

    def describe(self, room: int, request_id: int) -> str:
        """A room's staging, for a failure's message (under ``ctx.lock``): its
        regions granted per part or for the room, and its requests waiting."""
        key = (room, request_id)
        queued = sum(1 for _, _, r in self._queue if (r.room, r.request_id) == key)
        return (f"staging: {len(self._granted.get(key, {}))} part region(s) granted, "
                f"{len(self._pregranted.get(key, {}))} room region(s) granted with the request, "
                f"{queued} part request(s) waiting for room")

    def on_request(self, req: StageRequest) -> None:
        with self.ctx.lock:
            created = self.created(req.room, req.request_id)
            heapq.heappush(self._queue, (float("-inf") if created is None else created, next(self._arrivals), req))
        self.pump()

    def pump(self) -> float | None:
        """Free the quarantined regions that are due and grant waiting
        requests what fits; the seconds until the next quarantined region is
        due (None: none is quarantined)."""
        now = time.monotonic()
        area = self.ctx.staging.area
        with self.ctx.lock:
            for item in [q for q in self._quarantine if q[0] <= now]:
                self._quarantine.remove(item)
                area.free(item[1], item[2])
            self._grant(area)
            return min(q[0] for q in self._quarantine) - now if self._quarantine else None

    def _grant(self, area) -> None:
        """Grant the waiting requests, oldest room first, while regions fit
        (under the lock). The first that does not fit holds up the rest: a
        large region is never starved by smaller ones."""
        while self._queue:
            req = self._queue[0][2]
            if self.created(req.room, req.request_id) is None:
                heapq.heappop(self._queue)  # the room ended; its prefill learns from the abort
                continue
            if req.nbytes > area.max_region_bytes:
                heapq.heappop(self._queue)  # would never fit, and hold up the queue
                log.warning("staging request of %d bytes from %s refused: larger than a region can be",
                            req.nbytes, req.prefill_endpoint)
                continue
            offset = area.alloc(req.nbytes)
            if offset is None:
                return
            heapq.heappop(self._queue)
            self._granted.setdefault((req.room, req.request_id), {})[(req.prefill_tp_rank, req.part)] = \
                (offset, req.nbytes)
            try:
                self.ctx.channel.send(req.prefill_endpoint, StageGrant(
                    room=req.room, request_id=req.request_id, part=req.part, offset=offset))
            except KVFerryError as exc:
                log.warning("staging grant to %s not sent: %s", req.prefill_endpoint, exc)

    def on_staged(self, msg: ChunkStaged, receiver: StagedReceiver | None) -> None:
        """Scatter a landed part into ``receiver``'s pages (None: the room is
        gone; only free the region). The copy runs without ``ctx.lock``
        (other threads go on meanwhile); the room counts it in progress, so
        it cannot turn Failed, and its pages be reused, halfway through."""
        key = (msg.room, msg.request_id)
        with self.ctx.lock:
            parts = self._granted.get(key)
            grant = parts.pop((msg.prefill_tp_rank, msg.part), None) if parts is not None else None
            if parts is not None and not parts:
                del self._granted[key]
            free = grant is not None  # a part's own region; a room's is freed when the room ends
            if grant is None:
                room = self._pregranted.get(key, {}).get(msg.prefill_tp_rank)
                if room is not None and room[0] <= msg.offset and msg.offset + msg.nbytes <= room[0] + room[1]:
                    grant = (msg.offset, msg.nbytes)
            if grant is None or grant[1] != msg.nbytes:
                # A live room's part that matches no grant would leave the room waiting: said loudly.
                # (A room that ended released its grants: its late parts are expected.)
                log.log(logging.DEBUG if receiver is None else logging.WARNING,
                        "%s: staged part %d of room %d from prefill rank %d at [%d, +%d) matches no region granted "
                        "to it (%s): not scattered", self.ctx.where, msg.part, msg.room, msg.prefill_tp_rank,
                        msg.offset, msg.nbytes, "its room ended" if receiver is None else f"grant {grant}")
                return
            target = receiver.begin_scatter(msg) if receiver is not None else None
        error = None
        try:
            if target is not None:
                _SCATTERS[type(msg)](self.ctx, target, msg, grant[0], not free)
        except Exception as exc:
            error = exc
        finally:
            with self.ctx.lock:
                if target is not None:
                    receiver.end_scatter(msg, error)
                if free:
                    self.ctx.staging.area.free(*grant)
            if free:
                self.pump()

    def release_room(self, room: int, request_id: int, writers_lost: bool = True) -> None:
        """A room ended: its outstanding regions go to quarantine; with the
        fence they are freed (``writers_lost`` False: every prefill rank
        confirmed it stopped writing) or poisoned."""
        area, fenced = self.ctx.staging.area, self.ctx.staging.fenced
        with self.ctx.lock:
            regions = list(self._granted.pop((room, request_id), {}).values())
            pregranted = list(self._pregranted.pop((room, request_id), {}).values())
            self._pregranted_bytes -= sum(nbytes for _, nbytes in pregranted)
            regions += pregranted
            for offset, nbytes in regions:
                if not fenced:
                    self._quarantine.append((time.monotonic() + self.quarantine_s, offset, nbytes))
                elif writers_lost:
                    area.poison(offset, nbytes)
                else:
                    area.free(offset, nbytes)
        if fenced:
            self.pump()


def scatter_pages(ctx: RoomContext, target: ScatterTarget, msg: PagesStaged | ShareStaged, offset: int,
                  in_place: bool) -> None:
    """Unpack a part of pages (or a layer group's share of one) that landed
    at ``offset`` of the staging memory into the request's decode pages,
    pool by pool; a share only its layers (``in_place``: in a slot of the
    room's region, each layer at its place in the part's packing)."""
    dst_pages = target.pages
    if not (0 <= msg.page_start and msg.num_pages > 0 and msg.page_start + msg.num_pages <= len(dst_pages)):
        raise IndexError(f"staged pages [{msg.page_start}, +{msg.num_pages}) outside the request's "
                         f"{len(dst_pages)} pages")
    layers = part_layers(ctx, msg)
    packed = layers is not None and not in_place  # a share in its own region: only its layers
    expected = 0
    for a in target.routes:
        if a.send:
            pool = ctx.rank.pool(a.role)
            expected += staged_bytes(pool, page_slice(pool, a.dst_head_offset, a.num_heads), msg.num_pages,
                                     len(layers.get(a.role, ())) if packed else None)
    if expected != msg.nbytes:
        raise ValueError(f"staged part of {msg.nbytes} bytes, but {msg.num_pages} pages of the requested pools "
                         f"take {expected}" + (f" (layers {list(msg.layers)[:8]})" if packed else ""))
    mem = ctx.staging
    pages = page_tensor(dst_pages[msg.page_start:msg.page_start + msg.num_pages], mem.tensor.device)
    for a in target.routes:
        if a.send:
            pool = ctx.rank.pool(a.role)
            offset += scatter(mem.tensor, offset, mem.buffers, pool,
                              page_slice(pool, a.dst_head_offset, a.num_heads), pages, mem.word_views,
                              None if layers is None else layers.get(a.role, ()), in_place)


def part_layers(ctx: RoomContext, msg: PagesStaged | ShareStaged) -> dict | None:
    """Each pool's layers (by role) of a layer group's share of a part
    (``ShareStaged.layers``: room layers); None: a whole part. ValueError
    for layers this rank's pools do not have."""
    if not isinstance(msg, ShareStaged):
        return None
    spans = layer_spans(ctx.rank.pools)
    layers = np.asarray(msg.layers, dtype=np.int64)
    if layers.min() < 0 or layers.max() >= num_layers(spans):
        raise ValueError(f"staged part names layers {msg.layers[:8]}; this rank's pools have {num_layers(spans)}")
    return by_pool(layers, spans)


def scatter_state_part(ctx: RoomContext, target: ScatterTarget, msg: StateStaged, offset: int,
                       in_place: bool = False) -> None:
    """Unpack a staged part of state items (of ``msg.state_pool``) from the
    target's prefill rank that landed at ``offset`` into the room's decode
    items of that state pool (what that rank sends of each item: its row
    blocks). State parts are never in place."""
    states, prefill, index = target.states, target.rank, msg.state_pool
    items = states[index] if 0 <= index < len(states) else None
    if items is not None:  # positions not wanted (-1) were dropped where prefill paired the lists
        items = items[items >= 0]
    if items is None or not (0 <= msg.item_start and msg.num_items > 0
                             and msg.item_start + msg.num_items <= len(items)):
        raise IndexError(f"staged items [{msg.item_start}, +{msg.num_items}) of state pool {index} outside the "
                         f"{0 if items is None else len(items)} item(s) this room named for it")
    pool = ctx.rank.states[index]
    blocks = state_blocks(prefill.states[index], pool, prefill, ctx.rank, ctx.rank.tp_rank)
    per_item = sum(rb.item_bytes for rb in blocks)
    if msg.nbytes != msg.num_items * per_item:
        raise ValueError(f"staged part of {msg.nbytes} bytes, but {msg.num_items} item(s) of state {pool.kind} "
                         f"from prefill rank {prefill.tp_rank} take {msg.num_items * per_item}")
    mem = ctx.staging
    dst = page_tensor(items[msg.item_start:msg.item_start + msg.num_items], mem.tensor.device)
    scatter_state(mem.tensor, offset, state_rows(ctx.states[index]), dst, blocks)


#: How each kind of landed part is scattered.
_SCATTERS: dict[type, Callable[..., None]] = {PagesStaged: scatter_pages, ShareStaged: scatter_pages,
                                              StateStaged: scatter_state_part}


def count_scattered(ctx: RoomContext, counts, msg: ChunkStaged, routes) -> None:
    """Count a scattered part in its room's stats (``counts``, a
    :class:`~transfer.rooms.room_stats.RoomCounts`; ``routes``: what its
    prefill rank sends), by its kind."""
    if isinstance(msg, StateStaged):
        counts.land(f"state:{ctx.rank.states[msg.state_pool].kind}", "staged", msg.nbytes, 1)
    else:
        counts.staged(msg.prefill_tp_rank, routes, msg.num_pages, part_layers(ctx, msg))


def take_aux_row(ctx: RoomContext, slot: int, row: bytes) -> str | None:
    """Copy an aux row that came in a RoomStatus (fenced transfer) into aux
    slot ``slot``; what is wrong with it (None: copied)."""
    if not ctx.aux or not ctx.rank.aux or slot < 0 or len(row) != sum(a.slot_bytes for a in ctx.rank.aux):
        return f"sent an aux row of {len(row)} bytes; this room's aux slot is {slot}"
    write_aux_row(ctx.aux, slot, row)
    return None
