"""A prefill room's chunk, planned: what each decode rank gets of it, as
direct descriptors or as staged parts. Pure: numpy and the plan only.

For each decode request of the room a chunk becomes either

- a direct job: one :class:`~transfer.plan.TransferPlan` of descriptors from
  this rank's pools into the decode rank's pages (with the last chunk, its
  aux row too), always one per request, empty or not: its completion is what
  ends a room for a rank that sends nothing; or
- staged parts (:mod:`transfer.rooms.parts`, at most a part's size each), when the
  decode rank is fenced (nothing of its pools is writable), or when both
  sides have staging and the direct descriptors would be small (scattered
  pages, head slices): each part asks decode for a region of its staging,
  and is written there in the packed layout, gathered into local staging
  first, or straight from the pools when its pages lie in long runs
  (``direct``).

A layer group of a chunk (``Chunk.layers``) plans the same way: direct jobs
of the group's layers, and for a staged decode request the chunk's parts as
the whole chunk would cut them, each restricted to the group's layers
(a :class:`~transfer.rooms.parts.LayerShare` of the part, numbered as a part of its own).
Where decode granted the room a region with its request, a share's buffers
are written to their places in the part's slot of it (``in_place``);
otherwise a share asks for a region of its own size and is packed there
buffer after buffer, as a part of only those layers would be. Either way
decode scatters each share as it lands.

The last chunk also carries the room's state items (:mod:`transfer.state_pools`)
to each decode rank that asked this rank for them (``TransferRequest.dst_states``):
in the direct job, or, for a fenced decode rank, as staged parts of their own
(:class:`~transfer.rooms.parts.StatePart`), items packed buffer by buffer.

:func:`plan_chunk` raises :class:`~transfer.errors.RequestError` for pages
beyond ``init()``'s count, and ``ValueError`` / ``IndexError`` from the
plan's checks (page ids, sizes), before any byte moves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Mapping

import numpy as np

from bootstrap.messages import PoolRole, RankInfo, StatePoolDescriptor, StateSharding
from transfer.config import ManagerConfig
from transfer.errors import RequestError
from transfer.messages import INDEX_DTYPE, TransferRequest
from transfer.plan import (TransferPlan, check_state, check_transfer, page_runs, page_slice, pair_state_items,
                           plan_aux_regions, plan_pool, plan_state, staged_bytes)
from transfer.rooms.parts import LayerShare, PagePart, StagedSpec, StatePart, num_source_entries
from transfer.state_slices import RowBlocks, row_blocks
from transfer.state_slices import senders as slice_senders


@dataclass(frozen=True)
class SendingRoom:
    """What planning needs of a room: its rank (``local``), the decode
    requests and the handshaken decode ranks by session, ``init()``'s page
    count and aux slot (None: no aux row); ``where`` names it in errors.
    ``states``: per state pool of the rank, the room's item indices given
    with the last ``send()`` (None: none given)."""

    where: str
    local: RankInfo
    requests: tuple[TransferRequest, ...]
    peers: Mapping[str, RankInfo]
    num_pages: int
    aux_index: int | None
    states: tuple = ()


@dataclass(frozen=True)
class Chunk:
    """One ``send()``: prefill page ids from request position ``offset``;
    staged parts are numbered from ``first_part`` (the room's next).
    ``layers``: a layer group of the chunk (:mod:`transfer.rooms.layer_groups`),
    each pool's layers this call sends; None: every layer. ``last``: the
    call ends the room (for a layer group: it completes the last chunk)."""

    pages: np.ndarray
    offset: int
    last: bool
    first_part: int
    layers: Mapping[PoolRole, tuple[int, ...]] | None = None


@dataclass(frozen=True)
class DirectJob:
    """A decode rank's direct descriptors; ``moved``: (pool, path, bytes,
    descriptors) for the room's stats once it lands."""

    session: str
    plan: TransferPlan
    moved: tuple[tuple[str, str, int, int], ...]


@dataclass(frozen=True)
class ChunkPlan:
    """A chunk's (or layer group's) direct jobs and staged parts;
    ``next_part``: the number after its parts (the room's next)."""

    jobs: tuple[DirectJob, ...]
    parts: tuple[StagedSpec, ...]
    next_part: int = 0


def plan_chunk(room: SendingRoom, chunk: Chunk, config: ManagerConfig) -> ChunkPlan:
    """The chunk's direct jobs (one per request) and staged parts."""
    end = chunk.offset + chunk.pages.size
    if end > room.num_pages:
        raise RequestError(f"{room.where}: {end} pages sent, more than the {room.num_pages} of init()")
    if chunk.last and end != room.num_pages:
        raise RequestError(f"{room.where}: last chunk ends at page {end} of {room.num_pages}")
    local = room.local
    jobs, parts = [], []
    next_part = chunk.first_part
    for req in room.requests:
        peer = room.peers[req.decode_session]
        skip = min(chunk.pages.size, max(0, req.skip_pages - chunk.offset))  # decode has these already
        src = chunk.pages[skip:]
        dst = np.frombuffer(req.dst_pages, dtype=INDEX_DTYPE)[chunk.offset + skip:end]
        sent = [a for a in req.assignments if a.send] if src.size else []
        plans, roles = [], []
        if sent and _staged(src, dst, sent, local, peer, config):
            for a in sent:  # the same checks as the direct path, before any byte moves
                check_transfer(local.pool(a.role), peer.pool(a.role), src, dst.astype(np.int64),
                               src_head_offset=a.src_head_offset, dst_head_offset=a.dst_head_offset,
                               num_heads=a.num_heads)
            budget = _part_bytes(local, peer, config)
            if chunk.layers is not None:  # parts whose group share is about a part's size: fewer, larger shares
                budget *= _share_scale(local, sent, chunk.layers)
            new = _parts(req, src, chunk.offset + skip, local, budget, next_part, config)
            if chunk.layers is not None:  # the group's share of each part (none of a part it has no layer of)
                shares = [s for s in (LayerShare(p, p.part, chunk.layers) for p in new) if s.write_bytes]
                new = [replace(s, part=next_part + i) for i, s in enumerate(shares)]
            next_part += len(new)
            parts.extend(new)
        else:
            plans = [plan_pool(local.pool(a.role), peer.pool(a.role), src, dst, src_head_offset=a.src_head_offset,
                               dst_head_offset=a.dst_head_offset, num_heads=a.num_heads,
                               layers=None if chunk.layers is None else chunk.layers.get(a.role, ()))
                     for a in sent]
            roles = [a.role.value for a in sent]
        if chunk.last and local.aux and room.aux_index is not None and req.dst_aux_index >= 0:
            aux = plan_aux_regions(local.aux, peer.aux, room.aux_index, req.dst_aux_index)  # checks the slots
            if not peer.fenced:  # a fenced rank gets the row in RoomStatus
                plans.append(aux)
                roles.append("aux")
        if chunk.last and any(req.dst_states):
            before = len(parts)
            for kind, plan in _state_plans(room, req, peer, local, config, next_part, parts):
                if plan is not None:
                    plans.append(plan)
                    roles.append(f"state:{kind}")
            next_part += len(parts) - before
        moved = tuple((role, "direct", p.total_bytes, p.num_descriptors) for role, p in zip(roles, plans, strict=True)
                      if p.num_descriptors)
        jobs.append(DirectJob(req.decode_session, TransferPlan.concat(plans), moved))
    return ChunkPlan(tuple(jobs), tuple(parts), next_part)


def _state_plans(room: SendingRoom, req: TransferRequest, peer: RankInfo, local: RankInfo, config: ManagerConfig,
                 next_part: int, parts: list):
    """(kind, direct plan or None) for each state pool the
    request asks of this rank; a fenced decode rank's go to ``parts``
    instead (numbered from ``next_part``). Raises RequestError when the
    room named no items of a state decode asks for, ValueError / IndexError
    from the checks."""
    out = []
    for i, dst in enumerate(req.dst_states):
        if not dst:
            continue
        if i >= len(local.states):
            raise RequestError(f"{room.where}: decode asks for state pool {i}; this rank has {len(local.states)}")
        pool, theirs = local.states[i], peer.states[i]
        src = room.states[i] if i < len(room.states) else None
        if src is None:
            raise RequestError(f"{room.where}: decode asks for state {pool.kind}, but the last send() named no "
                               "state indices for it")
        src, dst = pair_state_items(pool, src, np.frombuffer(dst, dtype=INDEX_DTYPE))
        blocks = state_blocks(pool, theirs, local, peer, req.decode_tp_rank)
        if peer.fenced:
            check_state(pool, theirs, src, dst)
            new = _state_parts(req, i, pool, blocks, src, _part_bytes(local, peer, config), next_part,
                               local.staging is None)
            next_part += len(new)
            parts.extend(new)
            out.append((pool.kind, None))
        else:
            out.append((pool.kind, plan_state(pool, theirs, src, dst, blocks)))
    return out


def state_blocks(src: StatePoolDescriptor, dst: StatePoolDescriptor, prefill: RankInfo, decode: RankInfo,
                 decode_rank: int) -> tuple[RowBlocks, ...]:
    """What prefill rank ``prefill`` sends of each item of each buffer of a
    state pool to decode rank ``decode_rank`` (of ``decode``'s TP size):
    whole items, or a sharded state's slices between different TP sizes."""
    if src.sharding is StateSharding.REPLICATED:
        return tuple(RowBlocks(1, s.item_bytes, d.item_bytes, ((0, 0, s.item_bytes),))
                     for s, d in zip(src.buffers, dst.buffers, strict=True))
    first = slice_senders(src, prefill.tp_rank, prefill.tp_size, decode_rank, decode.tp_size)[0] == prefill.tp_rank
    return tuple(row_blocks(s, d, prefill.tp_rank, prefill.tp_size, decode_rank, decode.tp_size, first)
                 for s, d in zip(src.buffers, dst.buffers, strict=True))


def _state_parts(req: TransferRequest, index: int, pool: StatePoolDescriptor, blocks: tuple[RowBlocks, ...],
                 items: np.ndarray, part_bytes: int, first_part: int, direct: bool) -> list[StatePart]:
    """A state pool's items for a fenced decode rank, cut into staged parts
    of at most ``part_bytes`` (at least one item each); ``direct``: written
    from the buffers (no local staging), else gathered first."""
    per_item = sum(rb.item_bytes for rb in blocks)
    if per_item == 0:
        return []
    if per_item > part_bytes:
        raise ValueError(f"state {pool.kind}: one item is {per_item} bytes, more than a staged part can be "
                         f"({part_bytes} bytes: decode's staging arena); raise the staging arena size")
    step = max(1, part_bytes // per_item)
    return [StatePart(req, first_part + k, index, pool, blocks, items[o:o + step], o,
                      per_item * len(items[o:o + step]), direct)
            for k, o in enumerate(range(0, len(items), step))]


def _staged(pages, dst, sent, local: RankInfo, peer: RankInfo, config: ManagerConfig) -> bool:
    """Whether the chunk goes to this decode rank through staging: always
    when it is fenced, else when both sides have staging and the direct
    descriptors would average less than ``stage_below_bytes``."""
    if peer.fenced and pages.size:
        return True
    if local.staging is None or peer.staging is None or not pages.size:
        return False
    runs = page_runs(pages, dst).lengths.size
    total = count = 0
    for a in sent:
        pool = local.pool(a.role)
        sl, dl = page_slice(pool, a.src_head_offset, a.num_heads), \
            page_slice(peer.pool(a.role), a.dst_head_offset, a.num_heads)
        buffers = len(pool.buffers)
        whole = sl.rows == dl.rows == 1 and sl.nbytes == sl.row_bytes and dl.nbytes == dl.row_bytes
        total += pages.size * sl.packed_bytes * buffers
        count += runs * buffers if whole else pages.size * sl.rows * buffers
    return total / count < config.stage_below_bytes


def _share_scale(local: RankInfo, sent, layers: Mapping[PoolRole, tuple[int, ...]]) -> int:
    """How many times a page's bytes of the pools ``sent`` are those of
    the group's ``layers`` (at least 1): each share of a part cut that many
    times larger holds about a part's bytes. Each message and scatter of a
    share costs as a part's does, and behind a busy scheduler thread every
    one waits for the interpreter lock."""
    every = group = 0
    for a in sent:
        pool = local.pool(a.role)
        sl = page_slice(pool, a.src_head_offset, a.num_heads)
        every += staged_bytes(pool, sl, 1)
        group += staged_bytes(pool, sl, 1, len(layers.get(a.role, ())))
    return max(1, every // group) if group else 1


def _part_bytes(local: RankInfo, peer: RankInfo, config: ManagerConfig) -> int:
    """A part's size: several fit in both staging buffers (a fenced peer's:
    one arena's worth)."""
    remote = peer.staging.arena_size if peer.fenced else peer.staging.nbytes // 2
    here = local.staging.nbytes // 2 if local.staging is not None else remote
    return max(1, min(config.stage_part_bytes, here, remote))


def _parts(req: TransferRequest, pages: np.ndarray, page_start: int, local: RankInfo, part_bytes: int,
           first_part: int, config: ManagerConfig) -> list[PagePart]:
    """A decode request's pages cut into parts of at most ``part_bytes``."""
    pools = tuple((local.pool(a.role), page_slice(local.pool(a.role), a.src_head_offset, a.num_heads))
                  for a in req.assignments if a.send)
    per_page = sum(staged_bytes(p, sl, 1) for p, sl in pools)
    if per_page == 0:
        return []
    step = max(1, part_bytes // per_page)
    parts = []
    for i, o in enumerate(range(0, len(pages), step)):
        src = pages[o:o + step]
        nbytes = per_page * len(src)
        # Without local staging every part is written from the pools; with it,
        # those whose runs are long enough that a gather would only slow them down.
        direct = local.staging is None or nbytes / max(1, num_source_entries(src, pools)) >= config.stage_below_bytes
        parts.append(PagePart(req, first_part + i, src, page_start + o, pools, nbytes, direct,
                              _granted(req, page_start + o, per_page, nbytes)))
    return parts


def _granted(req: TransferRequest, page_start: int, per_page: int, nbytes: int) -> int | None:
    """A part's offset in the region the request granted (None: none). The
    region holds the room's pages from ``skip_pages`` on, in order; raises
    ValueError when the part does not fit in it."""
    if req.staging_offset < 0:
        return None
    start = (page_start - req.skip_pages) * per_page
    if start < 0 or start + nbytes > req.staging_nbytes:
        raise ValueError(f"a staged part of request pages [{page_start}, +{nbytes // per_page}) does not fit the "
                         f"{req.staging_nbytes} bytes decode granted")
    return req.staging_offset + start
