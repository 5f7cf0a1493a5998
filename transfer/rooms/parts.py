"""A staged part of a chunk, one type per kind. Each owns its packed layout,
its bytes, how it is gathered and written, how it counts in the room's
stats, and the message that tells decode it landed (one message kind per
part kind, :mod:`transfer.messages`). :mod:`transfer.rooms.chunk_plan`
plans them; :mod:`transfer.rooms.staged_prefill` runs them, whatever kind.

- :class:`PagePart`: a run of a decode request's pages, packed pool by pool
  (each pool's page slice, buffer by buffer, in (layer, component) order).
- :class:`LayerShare`: a layer group's share of a :class:`PagePart` (a
  layer-wise send), numbered as a part of its own: only the group's layers,
  written to their places in the part's slot of the room's region where
  decode granted one with its request (``in_place``), else packed one after
  the other in a region of its own.
- :class:`StatePart`: items of one state pool (:mod:`transfer.state_pools`),
  packed buffer by buffer, each item's row blocks
  (:mod:`transfer.state_slices`).

A part is *direct* when it is written from the pools straight into decode's
region (long page runs, or no local staging), else gathered into a local
region first; the rank's staging memory does the copies
(:meth:`~transfer.staging.area.StagingMemory.gather_pages`). Pure: numpy
and the plan (no torch, zmq or Mooncake).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping

import numpy as np

from bootstrap.messages import PoolDescriptor, PoolRole, StatePoolDescriptor
from transfer.messages import PagesStaged, ShareStaged, StateStaged, TransferRequest
from transfer.plan import PageSlice, TransferPlan, page_runs, staged_bytes
from transfer.rooms.layer_groups import layer_spans, room_layers
from transfer.state_slices import RowBlocks, block_entries

#: (stats role, bytes, descriptors) of what a part moved, for the room's counts.
Moved = tuple[tuple[str, int, int], ...]


class _Whole:
    """A part written whole: its ``nbytes`` are what it writes, one range
    from its region's start, in a region of their own size."""

    nbytes: int

    @property
    def write_bytes(self) -> int:
        """The bytes written (and gathered, unless direct)."""
        return self.nbytes

    @property
    def region_bytes(self) -> int:
        """The bytes of decode's staging it lands in."""
        return self.nbytes

    @property
    def in_place(self) -> bool:
        """Its bytes lie at their places in a larger slot (a share's only)."""
        return False

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """(offset in the region, bytes) of what it writes, in order."""
        return ((0, self.nbytes),)


@dataclass(frozen=True)
class PagePart(_Whole):
    """Part ``part`` of a chunk for one decode request: ``src_pages`` (from
    request position ``page_start``), packed pool by pool (``pools``: each
    pool with its page slice, in the request's assignment order), ``nbytes``
    in all. ``granted``: its offset in decode's staging when the request
    granted the room a region (``TransferRequest.staging_offset``), None when
    it must ask for one."""

    req: TransferRequest
    part: int
    src_pages: np.ndarray
    page_start: int
    pools: tuple[tuple[PoolDescriptor, PageSlice], ...]
    nbytes: int
    direct: bool
    granted: int | None = None

    def _layers(self, pool: PoolDescriptor) -> tuple[int, ...] | None:
        return None  # every layer

    def source_entries(self) -> tuple[np.ndarray, np.ndarray]:
        """Its packed layout as (source address, bytes) descriptors read
        straight from the pools (:func:`page_entries`)."""
        return page_entries(self.src_pages, self.pools, self._layers)

    def gather_into(self, mem, offset: int, states) -> None:
        """Pack it into ``mem`` (the rank's :class:`~transfer.staging.area.StagingMemory`)
        at ``offset``; ``states``: the rank's state pools (a state part's)."""
        mem.gather_pages(offset, self.src_pages, self.pools, self._layers)

    def moved(self) -> Moved:
        """What it moved, by pool (one descriptor, under its first pool)."""
        return _pages_moved(self.src_pages, self.pools, self._layers)

    def landed(self, room: int, tp_rank: int, offset: int, pools) -> PagesStaged:
        """The message telling decode it landed at ``offset`` (``pools``: this rank's)."""
        return PagesStaged(room=room, request_id=self.req.request_id, prefill_tp_rank=tp_rank, part=self.part,
                           offset=offset, nbytes=self.region_bytes, page_start=self.page_start,
                           num_pages=len(self.src_pages))

    def describe(self) -> str:
        return f"staged part {self.part} ({self.write_bytes} bytes)"


@dataclass(frozen=True)
class LayerShare:
    """Layer group ``layers`` (each pool's layers, by role) of ``whole``,
    numbered ``part`` among the room's parts."""

    whole: PagePart
    part: int
    layers: Mapping[PoolRole, tuple[int, ...]]

    @property
    def req(self) -> TransferRequest:
        return self.whole.req

    @property
    def src_pages(self) -> np.ndarray:
        return self.whole.src_pages

    @property
    def pools(self) -> tuple[tuple[PoolDescriptor, PageSlice], ...]:
        return self.whole.pools

    @property
    def direct(self) -> bool:
        return self.whole.direct

    @property
    def granted(self) -> int | None:
        return self.whole.granted

    @property
    def in_place(self) -> bool:
        """Written to its layers' places in the part's slot of the room's
        region (``granted``), not packed in a region of its own."""
        return self.whole.granted is not None

    @property
    def write_bytes(self) -> int:
        return sum(n for _, n in self.ranges())

    @property
    def region_bytes(self) -> int:
        """The part's slot when written in place, else its own bytes."""
        return self.whole.nbytes if self.in_place else self.write_bytes

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """(offset in the part, bytes) of the part's packed layout that the
        group covers, in order, adjacent ranges merged. Each pool's packing
        holds its buffers in (layer, component) order, each the part's pages."""
        out: list[list[int]] = []
        base, n = 0, len(self.src_pages)
        for pool, sl in self.pools:
            per_layer = staged_bytes(pool, sl, n, 1)
            for layer in self.layers.get(pool.role, ()):
                start = base + layer * per_layer
                if out and out[-1][0] + out[-1][1] == start:
                    out[-1][1] += per_layer
                else:
                    out.append([start, per_layer])
            base += staged_bytes(pool, sl, n)
        return tuple((o, b) for o, b in out)

    def _layers(self, pool: PoolDescriptor) -> tuple[int, ...]:
        return self.layers.get(pool.role, ())

    def source_entries(self) -> tuple[np.ndarray, np.ndarray]:
        return page_entries(self.src_pages, self.pools, self._layers)

    def gather_into(self, mem, offset: int, states) -> None:
        mem.gather_pages(offset, self.src_pages, self.pools, self._layers)

    def moved(self) -> Moved:
        return _pages_moved(self.src_pages, self.pools, self._layers)

    def landed(self, room: int, tp_rank: int, offset: int, pools) -> ShareStaged:
        w = self.whole
        spans = layer_spans(pools)
        return ShareStaged(room=room, request_id=w.req.request_id, prefill_tp_rank=tp_rank, part=self.part,
                           offset=offset, nbytes=self.region_bytes, page_start=w.page_start,
                           num_pages=len(w.src_pages),
                           layers=room_layers({pool.role: self._layers(pool) for pool, _ in w.pools}, spans))

    def describe(self) -> str:
        return (f"staged part {self.part} ({self.write_bytes} bytes of layers "
                f"{dict((r.value, list(ls)) for r, ls in self.layers.items() if ls)})")


@dataclass(frozen=True)
class StatePart(_Whole):
    """Part ``part``: items ``items`` (from position ``item_start`` of the
    request's list) of state pool ``index`` (``pool``), each item's row
    blocks (``blocks``, per buffer) packed buffer by buffer, ``nbytes`` in
    all. Never granted with the request (that region holds pages)."""

    req: TransferRequest
    part: int
    index: int
    pool: StatePoolDescriptor
    blocks: tuple[RowBlocks, ...]
    items: np.ndarray
    item_start: int
    nbytes: int
    direct: bool

    granted = None

    def source_entries(self) -> tuple[np.ndarray, np.ndarray]:
        """Buffer by buffer, each block by block, item by item, row by row
        (:func:`~transfer.state_slices.block_entries`)."""
        items = self.items.astype(np.int64)
        srcs, lengths = [], []
        for b, rb in zip(self.pool.buffers, self.blocks, strict=True):
            offs, n = block_entries(rb, items, b.item_bytes)
            srcs.append(b.addr + offs)
            lengths.append(n)
        return np.concatenate(srcs), np.concatenate(lengths)

    def gather_into(self, mem, offset: int, states) -> None:
        mem.gather_items(offset, states[self.index], self.items, self.blocks)

    def moved(self) -> Moved:
        return ((f"state:{self.pool.kind}", self.nbytes, 1),)

    def landed(self, room: int, tp_rank: int, offset: int, pools) -> StateStaged:
        return StateStaged(room=room, request_id=self.req.request_id, prefill_tp_rank=tp_rank, part=self.part,
                           offset=offset, nbytes=self.nbytes, state_pool=self.index, item_start=self.item_start,
                           num_items=len(self.items))

    def describe(self) -> str:
        return f"staged part {self.part} ({self.nbytes} bytes of state {self.pool.kind})"


#: Any staged part.
StagedSpec = PagePart | LayerShare | StatePart


def source_plan(spec: StagedSpec, dst_addr: int) -> TransferPlan:
    """A direct part's descriptors into the region at ``dst_addr``: packed
    from the region's start, or, in place, each at its place in the slot."""
    src, lengths = spec.source_entries()
    packed = np.concatenate(([0], np.cumsum(lengths)[:-1]))  # where each lies among the bytes written
    dst = dst_addr + (_placed(packed, spec.ranges()) if spec.in_place else packed)
    return TransferPlan(src.astype(np.uint64), dst.astype(np.uint64), lengths.astype(np.uint64))


def gathered_plan(spec: StagedSpec, src_addr: int, dst_addr: int) -> TransferPlan:
    """The descriptors that write a part gathered at ``src_addr`` (its bytes
    one after the other) to its region at ``dst_addr``: one, or, in place,
    one per range of the slot."""
    ranges = spec.ranges() if spec.in_place else ((0, spec.write_bytes),)
    lengths = np.asarray([n for _, n in ranges], dtype=np.uint64)
    src = src_addr + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return TransferPlan(src.astype(np.uint64), np.asarray([dst_addr + o for o, _ in ranges], dtype=np.uint64),
                        lengths)


def num_source_entries(pages: np.ndarray, pools) -> int:
    """How many descriptors a page part's :meth:`~PagePart.source_entries` gives (counted, not built)."""
    runs = 1 + int(np.count_nonzero(np.diff(pages) != 1)) if pages.size else 0
    count = 0
    for pool, sl in pools:
        buffers = pool.num_layers * len(pool.components)
        whole = sl.rows == 1 and sl.nbytes == sl.row_bytes and pool.dense
        count += buffers * (runs if whole else pages.size * sl.rows)
    return count


def page_entries(src_pages: np.ndarray, pools, layers_of) -> tuple[np.ndarray, np.ndarray]:
    """Pages of ``pools`` (each with its page slice) in their packed layout as
    (source address, bytes) descriptors: one per (buffer, page run) for
    whole pages, else one per (buffer, page, row) of the slice.
    ``layers_of(pool)``: the pool's layers packed (None: all)."""
    pages = src_pages.astype(np.int64)
    runs = page_runs(pages, pages)
    srcs, lengths = [], []
    for pool, sl in pools:
        addrs = {(b.layer, b.component): b.addr for b in pool.buffers}
        whole = sl.rows == 1 and sl.nbytes == sl.row_bytes and pool.dense
        layers = layers_of(pool)
        for layer in range(pool.num_layers) if layers is None else layers:
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


def _pages_moved(src_pages: np.ndarray, pools, layers_of) -> Moved:
    n = len(src_pages)
    out = []
    for i, (pool, sl) in enumerate(pools):
        layers = layers_of(pool)
        out.append((pool.role.value, staged_bytes(pool, sl, n, None if layers is None else len(layers)), int(i == 0)))
    return tuple(out)


def _placed(offsets: np.ndarray, ranges) -> np.ndarray:
    """Offsets among a share's bytes (its ``ranges`` one after the other)
    as offsets in the part: an entry never spans two ranges (each range is
    whole buffers)."""
    if len(ranges) == 1:
        return offsets + ranges[0][0]
    starts = np.asarray([o for o, _ in ranges], dtype=np.int64)
    ends = np.cumsum([n for _, n in ranges])
    which = np.searchsorted(ends, offsets, side="right")
    return offsets - (ends - np.asarray([n for _, n in ranges]))[which] + starts[which]
