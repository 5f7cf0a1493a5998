"""The staged path's message flow on decode (prefill's is
:mod:`transfer.rooms.staged_prefill`).

A StageRequest gets a region of the staging buffer (FIFO when it is full);
ChunkStaged scatters the region into the request's pages and frees it.
ChunkStaged and the final RoomStatus travel on the same ordered channel, so
decode has scattered every part before it reports Success.

A region granted to a room that then fails is freed only after
``quarantine_s``: a write still in flight to it would otherwise land in a
region handed to someone else. With the write fence (fenced staging: a
:class:`~transfer.staging.arenas.StagingArenas`) there is no quarantine: a
room whose prefill ranks confirmed they stopped writing frees its regions at
once; one with a lost writer poisons them (their arena is retired).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Protocol

import numpy as np

from transfer.errors import KVFerryError, TransferError
from transfer.messages import ChunkStaged, PoolAssignment, StageGrant, StageRequest
from transfer.plan import page_slice, staged_bytes
from transfer.rooms.context import RoomContext
from transfer.staging.copies import page_tensor, scatter, write_aux_row

log = logging.getLogger("kvferry.staging")


class StagedReceiver(Protocol):
    """What the flow needs of the room a part lands for (a
    :class:`~transfer.rooms.receiver.KVReceiver`); called under ``ctx.lock``."""

    @property
    def where(self) -> str: ...

    def staged_target(self, msg: ChunkStaged) -> tuple[np.ndarray, tuple[PoolAssignment, ...]] | None:
        """The request's decode pages and what the part's rank sends; None
        when the room takes no more parts."""

    def part_scattered(self, msg: ChunkStaged) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class DecodeStaging:
    """Grants staging regions to prefill ranks and scatters what lands."""

    def __init__(self, ctx: RoomContext, is_live: Callable[[int, int], bool], quarantine_s: float) -> None:
        """``is_live(room, request_id)``: whether the room still has a live
        receiver (called under ``ctx.lock``)."""
        self.ctx = ctx
        self.is_live = is_live
        self.quarantine_s = quarantine_s
        self._queue: collections.deque[StageRequest] = collections.deque()
        self._granted: dict[tuple[int, int, int, int], tuple[int, int]] = {}  # -> (offset, nbytes)
        self._quarantine: list[tuple[float, int, int]] = []

    def on_request(self, req: StageRequest) -> None:
        with self.ctx.lock:
            self._queue.append(req)
        self.pump()

    def pump(self) -> None:
        now = time.monotonic()
        area = self.ctx.staging.area
        with self.ctx.lock:
            for item in [q for q in self._quarantine if q[0] <= now]:
                self._quarantine.remove(item)
                area.free(item[1], item[2])
            while self._queue:
                req = self._queue[0]
                if not self.is_live(req.room, req.request_id):
                    self._queue.popleft()  # the room ended; its prefill learns from the abort
                    continue
                if req.nbytes > area.max_region_bytes:
                    self._queue.popleft()  # would never fit, and hold up the queue
                    log.warning("staging request of %d bytes from %s refused: larger than a region can be",
                                req.nbytes, req.prefill_endpoint)
                    continue
                offset = area.alloc(req.nbytes)
                if offset is None:
                    return
                self._queue.popleft()
                self._granted[(req.room, req.request_id, req.prefill_tp_rank, req.part)] = (offset, req.nbytes)
                try:
                    self.ctx.channel.send(req.prefill_endpoint, StageGrant(
                        room=req.room, request_id=req.request_id, part=req.part, offset=offset))
                except KVFerryError as exc:
                    log.warning("staging grant to %s not sent: %s", req.prefill_endpoint, exc)

    def on_staged(self, msg: ChunkStaged, receiver: StagedReceiver | None) -> None:
        """Scatter a landed part into ``receiver``'s pages (None: the room is
        gone; only free the region). Under ``ctx.lock``, on purpose: a room
        cannot turn Failed (and its pages be reused) halfway through."""
        key = (msg.room, msg.request_id, msg.prefill_tp_rank, msg.part)
        with self.ctx.lock:
            grant = self._granted.pop(key, None)
            if grant is None or grant[1] != msg.nbytes:
                return
            try:
                target = receiver.staged_target(msg) if receiver is not None else None
                if target is not None:
                    try:
                        scatter_part(self.ctx, target[0], msg, grant[0], target[1])
                    except Exception as exc:
                        receiver.fail(TransferError(f"{receiver.where}: scattering staged part {msg.part}: {exc}"))
                    else:
                        receiver.part_scattered(msg)
            finally:
                self.ctx.staging.area.free(*grant)
                self.pump()

    def release_room(self, room: int, request_id: int, writers_lost: bool = True) -> None:
        """A room ended: its outstanding regions go to quarantine; with the
        fence they are freed (``writers_lost`` False: every prefill rank
        confirmed it stopped writing) or poisoned."""
        area, fenced = self.ctx.staging.area, self.ctx.staging.fenced
        with self.ctx.lock:
            for key in [k for k in self._granted if k[:2] == (room, request_id)]:
                offset, nbytes = self._granted.pop(key)
                if not fenced:
                    self._quarantine.append((time.monotonic() + self.quarantine_s, offset, nbytes))
                elif writers_lost:
                    area.poison(offset, nbytes)
                else:
                    area.free(offset, nbytes)
        if fenced:
            self.pump()


def scatter_part(ctx: RoomContext, dst_pages: np.ndarray, msg: ChunkStaged, offset: int, assignments) -> None:
    """Unpack a part that landed at ``offset`` of the staging memory into
    ``dst_pages`` (the request's decode pages, in request order), pool by pool."""
    if not (0 <= msg.page_start and msg.num_pages > 0 and msg.page_start + msg.num_pages <= len(dst_pages)):
        raise IndexError(f"staged pages [{msg.page_start}, +{msg.num_pages}) outside the request's "
                         f"{len(dst_pages)} pages")
    slices = [(ctx.rank.pool(a.role), a) for a in assignments if a.send]
    expected = sum(staged_bytes(pool, page_slice(pool, a.dst_head_offset, a.num_heads), msg.num_pages)
                   for pool, a in slices)
    if expected != msg.nbytes:
        raise ValueError(f"staged part of {msg.nbytes} bytes, but {msg.num_pages} pages of the requested pools "
                         f"take {expected}")
    mem = ctx.staging
    dst = dst_pages[msg.page_start:msg.page_start + msg.num_pages]
    pages = page_tensor(dst, mem.tensor.device)
    for a in assignments:
        if a.send:
            pool = ctx.rank.pool(a.role)
            offset += scatter(mem.tensor, offset, mem.buffers, pool,
                              page_slice(pool, a.dst_head_offset, a.num_heads), pages, mem.word_views)


def take_aux_row(ctx: RoomContext, slot: int, row: bytes) -> str | None:
    """Copy an aux row that came in a RoomStatus (fenced transfer) into aux
    slot ``slot``; what is wrong with it (None: copied)."""
    if not ctx.aux or not ctx.rank.aux or slot < 0 or len(row) != sum(a.slot_bytes for a in ctx.rank.aux):
        return f"sent an aux row of {len(row)} bytes; this room's aux slot is {slot}"
    write_aux_row(ctx.aux, slot, row)
    return None
