"""The staged path's message flow, both sides. See :mod:`transfer.staging`.

Prefill, per part (a run of a chunk's pages for one decode rank)::

    local staging region free  ->  StageRequest to decode
    StageGrant                 ->  gather into local staging, write it to decode's region
    write landed               ->  ChunkStaged to decode; the part counts as done

Decode: a StageRequest gets a region of the staging buffer (FIFO when it is
full); ChunkStaged scatters the region into the request's pages and frees
it. ChunkStaged and the final RoomStatus travel on the same ordered channel,
so decode has scattered every part before it reports Success.

A region granted to a room that then fails is freed only after
``quarantine_s``: a write still in flight to it would otherwise land in a
region handed to someone else.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from bootstrap.messages import PoolDescriptor
from transfer.errors import KVFerryError, TransferError
from transfer.messages import ChunkStaged, StageGrant, StageRequest
from transfer.plan import PageSlice, TransferPlan, page_slice
from transfer.staging import gather, scatter, staged_bytes

log = logging.getLogger("kvferry.staging")


@dataclass
class StagedPart:
    """Part of one chunk for one decode rank, staged."""

    sender: object  # the KVSender
    req: object  # its TransferRequest
    part: int
    src_pages: np.ndarray
    page_start: int
    pools: list[tuple[PoolDescriptor, PageSlice]]  # in the request's assignment order
    nbytes: int
    local_offset: int = -1


def plan_parts(sender, req, pages: np.ndarray, page_start: int, local, peer, part_bytes: int,
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


def part_bytes_for(mgr, peer) -> int:
    """Part size both staging buffers can hold several of."""
    return min(mgr.config.stage_part_bytes, mgr.rank.staging.nbytes // 2, peer.staging.nbytes // 2)


class PrefillStaging:
    """Runs staged parts for a prefill rank's senders."""

    def __init__(self, mgr) -> None:
        self.mgr = mgr
        self._waiting: collections.deque[StagedPart] = collections.deque()
        self._granting: dict[tuple[int, int, int], StagedPart] = {}

    def submit(self, parts: list[StagedPart]) -> None:
        self._waiting.extend(parts)
        self.pump()

    def pump(self) -> None:
        """Give free local staging to waiting parts, in order, and ask decode."""
        with self.mgr._lock:
            while self._waiting:
                part = self._waiting[0]
                if part.sender._state.terminal:
                    self._waiting.popleft()
                    part.sender._on_chunk_done(None)  # counts as done for a failed room
                    continue
                offset = self.mgr.staging_area.alloc(part.nbytes)
                if offset is None:
                    return
                self._waiting.popleft()
                part.local_offset = offset
                req = part.req
                self._granting[(part.sender.room, req.request_id, part.part)] = part
                try:
                    self.mgr.channel.send(req.decode_endpoint, StageRequest(
                        room=part.sender.room, request_id=req.request_id, prefill_tp_rank=self.mgr.rank.tp_rank,
                        prefill_endpoint=self.mgr.rank.control_endpoint, part=part.part, nbytes=part.nbytes))
                except KVFerryError as exc:
                    self._finish(part, exc)

    def on_grant(self, grant: StageGrant) -> None:
        with self.mgr._lock:
            part = self._granting.pop((grant.room, grant.request_id, grant.part), None)
        if part is None:
            return
        if part.sender._state.terminal:
            self._finish(part, None)
            return
        try:
            peer = self.mgr.rooms.peers[part.req.decode_session]
            if not 0 <= grant.offset <= peer.staging.nbytes - part.nbytes:
                raise IndexError(f"decode granted [{grant.offset}, +{part.nbytes}) outside its staging buffer "
                                 f"of {peer.staging.nbytes} bytes")
            offset = part.local_offset
            pages = torch.from_numpy(part.src_pages.astype(np.int64)).to(self.mgr.staging.device)
            for pool, sl in part.pools:
                offset += gather(self.mgr.staging, offset, self.mgr.buffers, pool, sl, pages, self.mgr.word_views)
            plan = TransferPlan(np.asarray([self.mgr.rank.staging.addr + part.local_offset], dtype=np.uint64),
                                np.asarray([peer.staging.addr + grant.offset], dtype=np.uint64),
                                np.asarray([part.nbytes], dtype=np.uint64))
        except Exception as exc:
            self._finish(part, TransferError(f"{part.sender._state.where}: staging part {part.part}: {exc}"))
            return
        self.mgr.transport.submit(part.req.decode_session, plan,
                                  lambda err, p=part, off=grant.offset: self._landed(p, off, err))

    def release(self, sender) -> None:
        """A sender failed: free the local regions of its parts still waiting
        for a grant (no write reads them yet; parts being written free
        theirs when the write ends), and drop its parts not started."""
        with self.mgr._lock:
            stale = [k for k, p in self._granting.items() if p.sender is sender]
            for key in stale:
                part = self._granting.pop(key)
                self._finish(part, None)
            waiting = [p for p in self._waiting if p.sender is sender]
            for part in waiting:
                self._waiting.remove(part)
                sender._on_chunk_done(None)

    def _landed(self, part: StagedPart, remote_offset: int, error) -> None:
        if error is None:
            try:
                self.mgr.channel.send(part.req.decode_endpoint, ChunkStaged(
                    room=part.sender.room, request_id=part.req.request_id, prefill_tp_rank=self.mgr.rank.tp_rank,
                    part=part.part, offset=remote_offset, nbytes=part.nbytes, page_start=part.page_start,
                    num_pages=len(part.src_pages)))
            except KVFerryError as exc:
                error = exc
        self._finish(part, error)

    def _finish(self, part: StagedPart, error, *, notify: bool = True) -> None:
        if part.local_offset >= 0:
            self.mgr.staging_area.free(part.local_offset, part.nbytes)
            part.local_offset = -1
        if notify:
            part.sender._on_chunk_done(error)
        self.pump()


class DecodeStaging:
    """Grants staging regions to prefill ranks and scatters what lands."""

    def __init__(self, mgr, quarantine_s: float) -> None:
        self.mgr = mgr
        self.quarantine_s = quarantine_s
        self._queue: collections.deque[StageRequest] = collections.deque()
        self._granted: dict[tuple[int, int, int, int], tuple[int, int]] = {}  # -> (offset, nbytes)
        self._quarantine: list[tuple[float, int, int]] = []

    def on_request(self, req: StageRequest) -> None:
        with self.mgr._lock:
            self._queue.append(req)
        self.pump()

    def pump(self) -> None:
        now = time.monotonic()
        area = self.mgr.staging_area
        with self.mgr._lock:
            for item in [q for q in self._quarantine if q[0] <= now]:
                self._quarantine.remove(item)
                area.free(item[1], item[2])
            while self._queue:
                req = self._queue[0]
                if (req.room, req.request_id) not in self.mgr.rooms.receivers:
                    self._queue.popleft()  # the room ended; its prefill learns from the abort
                    continue
                offset = area.alloc(req.nbytes)
                if offset is None:
                    return
                self._queue.popleft()
                self._granted[(req.room, req.request_id, req.prefill_tp_rank, req.part)] = (offset, req.nbytes)
                try:
                    self.mgr.channel.send(req.prefill_endpoint, StageGrant(
                        room=req.room, request_id=req.request_id, part=req.part, offset=offset))
                except KVFerryError as exc:
                    log.warning("staging grant to %s not sent: %s", req.prefill_endpoint, exc)

    def on_staged(self, msg: ChunkStaged, receiver) -> None:
        """Scatter a landed part into ``receiver``'s pages (None: the room is
        gone; only free the region)."""
        key = (msg.room, msg.request_id, msg.prefill_tp_rank, msg.part)
        with self.mgr._lock:
            grant = self._granted.pop(key, None)
        if grant is None or grant[1] != msg.nbytes:
            return
        try:
            if receiver is not None:
                receiver._scatter(msg, grant[0])
        finally:
            self.mgr.staging_area.free(*grant)
            self.pump()

    def release_room(self, room: int, request_id: int) -> None:
        """A room ended: its outstanding regions go to quarantine."""
        with self.mgr._lock:
            for key in [k for k in self._granted if k[:2] == (room, request_id)]:
                offset, nbytes = self._granted.pop(key)
                self._quarantine.append((time.monotonic() + self.quarantine_s, offset, nbytes))


def scatter_part(mgr, receiver, msg: ChunkStaged, offset: int, assignments) -> None:
    """Unpack a landed part into the receiver's pages, pool by pool."""
    if not (0 <= msg.page_start and msg.num_pages > 0 and msg.page_start + msg.num_pages <= len(receiver._pages)):
        raise IndexError(f"staged pages [{msg.page_start}, +{msg.num_pages}) outside the request's "
                         f"{len(receiver._pages)} pages")
    slices = [(mgr.rank.pool(a.role), a) for a in assignments if a.send]
    expected = sum(staged_bytes(pool, page_slice(pool, a.dst_head_offset, a.num_heads), msg.num_pages)
                   for pool, a in slices)
    if expected != msg.nbytes:
        raise ValueError(f"staged part of {msg.nbytes} bytes, but {msg.num_pages} pages of the requested pools "
                         f"take {expected}")
    dst = receiver._pages[msg.page_start:msg.page_start + msg.num_pages]
    pages = torch.from_numpy(dst.astype(np.int64)).to(mgr.staging.device)
    for a in assignments:
        if a.send:
            pool = mgr.rank.pool(a.role)
            offset += scatter(mgr.staging, offset, mgr.buffers, pool,
                              page_slice(pool, a.dst_head_offset, a.num_heads), pages, mgr.word_views)
