"""The staged path's message flow on prefill (decode's is
:mod:`transfer.staging.decode_flow`; the copies :mod:`transfer.staging.copies`).

Prefill, per part (a run of a chunk's pages for one decode rank)::

    local staging region free  ->  StageRequest to decode
    StageGrant                 ->  gather into local staging, write it to decode's region
    write landed               ->  ChunkStaged to decode; the part counts as done

A *direct* part (its source pages in long runs, or no local staging; see
:func:`mark_direct`) needs no local region: on its grant its runs are
written from the pool straight into decode's region, in the packed layout.

A part's local region is freed when its write ended (or, for a room that
failed, when no write reads it); a part of a failed room counts as done.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Mapping, Protocol

import numpy as np

from bootstrap.messages import PoolDescriptor, RankInfo
from transfer.errors import KVFerryError, TransferError
from transfer.messages import ChunkStaged, StageGrant, StageRequest
from transfer.plan import PageSlice, TransferPlan, page_runs, page_slice
from transfer.ready import ReadyWaiter
from transfer.rooms.context import RoomContext
from transfer.staging.copies import gather, page_tensor, staged_bytes

log = logging.getLogger("kvferry.staging")


class StagedSender(Protocol):
    """What the flow needs of a part's sender (a :class:`~transfer.sender.KVSender`)."""

    room: int

    @property
    def terminal(self) -> bool: ...

    @property
    def where(self) -> str: ...

    def on_chunk_done(self, error) -> None:
        """One of the sender's submitted jobs or parts ended (``error`` None: landed)."""

    def on_part_landed(self, part: "StagedPart") -> None:
        """A part's write landed (for the room's stats; before ``on_chunk_done``)."""


@dataclass
class StagedPart:
    """Part of one chunk for one decode rank, staged."""

    sender: StagedSender
    req: object  # its TransferRequest
    part: int
    src_pages: np.ndarray
    page_start: int
    pools: list[tuple[PoolDescriptor, PageSlice]]  # in the request's assignment order
    nbytes: int
    local_offset: int = -1
    direct: bool = False  # written from the pool, not gathered (see mark_direct)
    ready: object = None  # a transfer.ready.ReadyGate: gather only once it is done


def plan_parts(sender: StagedSender, req, pages: np.ndarray, page_start: int, local, peer, part_bytes: int,
               first_part: int) -> list[StagedPart]:
    """Cut a chunk for one decode rank into parts of at most ``part_bytes``."""
    pools = [(local.pool(a.role), page_slice(local.pool(a.role), a.src_head_offset, a.num_heads))
             for a in req.assignments if a.send]
    per_page = sum(staged_bytes(p, sl, 1) for p, sl in pools)
    if per_page == 0:
        return []
    step = max(1, part_bytes // per_page)
    return [StagedPart(sender, req, first_part + i, pages[o:o + step], page_start + o, pools,
                       per_page * len(pages[o:o + step]))
            for i, o in enumerate(range(0, len(pages), step))]


def part_bytes_for(ctx: RoomContext, peer: RankInfo) -> int:
    """Part size both staging buffers can hold several of (a fenced peer's:
    one arena's worth)."""
    remote = peer.staging.arena_size if peer.fenced else peer.staging.nbytes // 2
    local = ctx.rank.staging.nbytes // 2 if ctx.rank.staging is not None else remote
    return max(1, min(ctx.config.stage_part_bytes, local, remote))


def _source_entries(part: StagedPart) -> tuple[np.ndarray, np.ndarray]:
    """The part's packed layout as (source address, bytes) descriptors read
    straight from the pools: one per (buffer, page run) for whole pages,
    else one per (buffer, page, row) of the slice."""
    pages = part.src_pages.astype(np.int64)
    runs = page_runs(pages, pages)
    srcs, lengths = [], []
    for pool, sl in part.pools:
        addrs = {(b.layer, b.component): b.addr for b in pool.buffers}
        whole = sl.rows == 1 and sl.nbytes == sl.row_bytes and pool.dense
        for layer in range(pool.num_layers):
            for comp in pool.components:
                base = addrs[(layer, comp)]
                if whole:
                    srcs.append(base + runs.src_starts * pool.page_bytes)
                    lengths.append(runs.lengths * sl.packed_bytes)
                else:
                    rows = pages[:, None] * pool.page_stride + np.arange(sl.rows)[None, :] * sl.row_bytes
                    srcs.append(base + sl.start + rows.reshape(-1))
                    lengths.append(np.full(rows.size, sl.nbytes, dtype=np.int64))
    return np.concatenate(srcs), np.concatenate(lengths)


def mark_direct(parts: list[StagedPart], ctx: RoomContext) -> None:
    """Mark the parts written straight from the pools: every part without
    local staging, else those whose descriptors would average at least
    ``stage_below_bytes`` (contiguous page runs), which a gather would only
    slow down."""
    for part in parts:
        if ctx.staging is None:
            part.direct = True
        else:
            _, lengths = _source_entries(part)
            part.direct = part.nbytes / max(1, lengths.size) >= ctx.config.stage_below_bytes


def source_plan(part: StagedPart, dst_addr: int) -> TransferPlan:
    """A direct part's descriptors into the region at ``dst_addr``."""
    src, lengths = _source_entries(part)
    dst = dst_addr + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return TransferPlan(src.astype(np.uint64), dst.astype(np.uint64), lengths.astype(np.uint64))


class PrefillStaging:
    """Runs staged parts for a prefill rank's senders."""

    def __init__(self, ctx: RoomContext, peers: Mapping[str, RankInfo]) -> None:
        """``peers``: the handshaken decode ranks by session (the room
        table's, read under ``ctx.lock``)."""
        self.ctx = ctx
        self.peers = peers
        self._waiting: collections.deque[StagedPart] = collections.deque()
        self._waiter = ReadyWaiter("kvferry-ready")
        self._granting: dict[tuple[int, int, int], StagedPart] = {}

    def submit(self, parts: list[StagedPart], ready=None) -> None:
        """Queue a chunk's parts; with ``ready`` (a
        :class:`~transfer.ready.ReadyGate` not done yet) only once it is
        done, never blocking this thread (a part of a gate past its deadline
        ends with the error)."""
        if ready is not None and not ready.done():
            self._waiter.when_ready(ready, lambda error: self._ready(parts, error))
            return
        self._waiting.extend(parts)
        self.pump()

    def _ready(self, parts: list[StagedPart], error) -> None:
        if error is None:
            with self.ctx.lock:
                self.submit(parts)
            return
        for part in parts:
            part.sender.on_chunk_done(TransferError(f"{part.sender.where}: staging part {part.part}: {error}"))

    def pump(self) -> None:
        """Give free local staging to waiting parts, in order, and ask decode."""
        with self.ctx.lock:
            while self._waiting:
                part = self._waiting[0]
                if part.sender.terminal:
                    self._waiting.popleft()
                    part.sender.on_chunk_done(None)  # counts as done for a failed room
                    continue
                offset = -1 if part.direct else self.ctx.staging.area.alloc(part.nbytes)
                if offset is None:
                    return
                self._waiting.popleft()
                part.local_offset = offset
                req = part.req
                self._granting[(part.sender.room, req.request_id, part.part)] = part
                try:
                    self.ctx.channel.send(req.decode_endpoint, StageRequest(
                        room=part.sender.room, request_id=req.request_id, prefill_tp_rank=self.ctx.rank.tp_rank,
                        prefill_endpoint=self.ctx.rank.control_endpoint, part=part.part, nbytes=part.nbytes))
                except KVFerryError as exc:
                    self._finish(part, exc)

    def on_grant(self, grant: StageGrant) -> None:
        with self.ctx.lock:
            part = self._granting.pop((grant.room, grant.request_id, grant.part), None)
        if part is None:
            return
        if part.sender.terminal:
            self._finish(part, None)
            return
        try:
            peer = self.peers[part.req.decode_session]
            arena = peer.staging.arena_size
            if not 0 <= grant.offset <= peer.staging.nbytes - part.nbytes or \
                    grant.offset // arena != (grant.offset + part.nbytes - 1) // arena:
                raise IndexError(f"decode granted [{grant.offset}, +{part.nbytes}) outside its staging buffer "
                                 f"of {peer.staging.nbytes} bytes or across one of its {arena}-byte arenas")
            if part.ready is not None:
                part.ready.wait()  # done already: submit() queued the part only then
            if part.direct:
                plan = source_plan(part, peer.staging.addr + grant.offset)
            else:
                plan = self._gathered(part, peer.staging.addr + grant.offset)
        except Exception as exc:
            self._finish(part, TransferError(f"{part.sender.where}: staging part {part.part}: {exc}"))
            return
        self.ctx.transport.submit(part.req.decode_session, plan,
                                  lambda err, p=part, off=grant.offset: self._landed(p, off, err))

    def _gathered(self, part: StagedPart, dst_addr: int) -> TransferPlan:
        """Gather a part into its local region; the one descriptor that writes it."""
        offset = part.local_offset
        mem = self.ctx.staging
        pages = page_tensor(part.src_pages, mem.tensor.device)
        for pool, sl in part.pools:
            offset += gather(mem.tensor, offset, mem.buffers, pool, sl, pages, mem.word_views)
        return TransferPlan(np.asarray([self.ctx.rank.staging.addr + part.local_offset], dtype=np.uint64),
                            np.asarray([dst_addr], dtype=np.uint64), np.asarray([part.nbytes], dtype=np.uint64))

    def release(self, sender) -> None:
        """A sender failed: free the local regions of its parts still waiting
        for a grant (no write reads them yet; parts being written free
        theirs when the write ends), and drop its parts not started."""
        with self.ctx.lock:
            stale = [k for k, p in self._granting.items() if p.sender is sender]
            for key in stale:
                part = self._granting.pop(key)
                self._finish(part, None)
            waiting = [p for p in self._waiting if p.sender is sender]
            for part in waiting:
                self._waiting.remove(part)
                sender.on_chunk_done(None)

    def _landed(self, part: StagedPart, remote_offset: int, error) -> None:
        if error is None:
            part.sender.on_part_landed(part)
            try:
                self.ctx.channel.send(part.req.decode_endpoint, ChunkStaged(
                    room=part.sender.room, request_id=part.req.request_id, prefill_tp_rank=self.ctx.rank.tp_rank,
                    part=part.part, offset=remote_offset, nbytes=part.nbytes, page_start=part.page_start,
                    num_pages=len(part.src_pages)))
            except KVFerryError as exc:
                error = exc
        self._finish(part, error)

    def _finish(self, part: StagedPart, error, *, notify: bool = True) -> None:
        if part.local_offset >= 0:
            self.ctx.staging.area.free(part.local_offset, part.nbytes)
            part.local_offset = -1
        if notify:
            part.sender.on_chunk_done(error)
        self.pump()
