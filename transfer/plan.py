"""Transfer planning: (layouts, page lists, head slice) -> descriptor arrays. Pure.

A plan is three equal-length uint64 arrays ``(src_addrs, dst_addrs,
lengths)``; every entry is one transfer-engine descriptor. Runs of pages that
are consecutive on both sides become one descriptor per buffer, and entries
that touch on both sides are merged again after all buffers are planned. The
executor never looks at layouts: it moves what the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bootstrap.messages import AuxDescriptor, PageLayout, PoolDescriptor, StatePoolDescriptor
from transfer.state_slices import block_entries

_U64 = np.uint64


@dataclass(frozen=True)
class TransferPlan:
    src_addrs: np.ndarray
    dst_addrs: np.ndarray
    lengths: np.ndarray

    @property
    def num_descriptors(self) -> int:
        return int(self.lengths.size)

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum(dtype=_U64)) if self.lengths.size else 0

    @staticmethod
    def empty() -> TransferPlan:
        z = np.zeros(0, dtype=_U64)
        return TransferPlan(z, z, z)

    @staticmethod
    def concat(plans: list[TransferPlan]) -> TransferPlan:
        plans = [p for p in plans if p.num_descriptors]
        if not plans:
            return TransferPlan.empty()
        return TransferPlan(
            np.concatenate([p.src_addrs for p in plans]),
            np.concatenate([p.dst_addrs for p in plans]),
            np.concatenate([p.lengths for p in plans]),
        )


@dataclass(frozen=True)
class PageRuns:
    """Runs of pages consecutive on both sides: ``src_starts[i]..+lengths[i]``
    go to ``dst_starts[i]..+lengths[i]``."""

    src_starts: np.ndarray
    dst_starts: np.ndarray
    lengths: np.ndarray


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> PageRuns:
    """Split paired page lists where either side jumps."""
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"page lists differ in shape: {src.shape} vs {dst.shape}")
    if src.size == 0:
        e = np.zeros(0, dtype=np.int64)
        return PageRuns(e, e, e)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return PageRuns(src[starts], dst[starts], lengths)


def check_pages(pages: np.ndarray, num_pages: int, where: str) -> None:
    """Raise IndexError naming ``where`` if any page index is outside the pool."""
    if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        bad = pages[(pages < 0) | (pages >= num_pages)][0]
        raise IndexError(f"{where}: page index {int(bad)} outside the pool of {num_pages} pages")


def check_transfer(src: PoolDescriptor, dst: PoolDescriptor, src_pages: np.ndarray, dst_pages: np.ndarray,
                   *, src_head_offset: int = 0, dst_head_offset: int = 0, num_heads: int | None = None) -> int:
    """Everything a move of pages of one pool must respect, checked before any
    byte moves, by the direct and the staged path alike: page indices inside
    both pools, matching shapes, the head slice inside both sides' heads.
    Returns the number of heads moved; raises IndexError or ValueError."""
    check_pages(src_pages, src.num_pages, f"{src.role.value} pool (source)")
    check_pages(dst_pages, dst.num_pages, f"{dst.role.value} pool (destination)")
    if src.page_size != dst.page_size or src.itemsize != dst.itemsize or src.head_dim != dst.head_dim:
        raise ValueError(f"{src.role.value} pool: page size, item size and head dim must match")
    if src.page_layout is not dst.page_layout or src.kv_layout is not dst.kv_layout:
        raise ValueError(f"{src.role.value} pool: page layouts differ")
    heads = src.num_kv_heads if num_heads is None else num_heads
    if heads < 1 or src_head_offset < 0 or dst_head_offset < 0 \
            or src_head_offset + heads > src.num_kv_heads or dst_head_offset + heads > dst.num_kv_heads:
        raise ValueError(f"{src.role.value} pool: head slice of {heads} heads at {src_head_offset} -> "
                         f"{dst_head_offset} is outside the local heads ({src.num_kv_heads} -> {dst.num_kv_heads})")
    return heads


def plan_pool(src: PoolDescriptor, dst: PoolDescriptor, src_pages: np.ndarray, dst_pages: np.ndarray,
              *, src_head_offset: int = 0, dst_head_offset: int = 0, num_heads: int | None = None,
              layers=None) -> TransferPlan:
    """Plan moving pages of one pool. Buffers are paired by (layer,
    component), never by position. With ``num_heads`` smaller than a side's
    heads per token, only that head slice moves, token by token.
    ``layers``: only these layers of the pool (a layer-wise send); None: all."""
    src_pages = np.asarray(src_pages, dtype=np.int64)
    dst_pages = np.asarray(dst_pages, dtype=np.int64)
    heads = check_transfer(src, dst, src_pages, dst_pages, src_head_offset=src_head_offset,
                           dst_head_offset=dst_head_offset, num_heads=num_heads)
    runs = page_runs(src_pages, dst_pages)
    layers = range(src.num_layers) if layers is None else layers
    if runs.lengths.size == 0 or not len(layers):
        return TransferPlan.empty()
    whole_pages = heads == src.num_kv_heads == dst.num_kv_heads
    if whole_pages and src.dense and dst.dense:
        src_off = runs.src_starts * src.page_bytes
        dst_off = runs.dst_starts * dst.page_bytes
        lengths = runs.lengths * src.page_bytes
    elif whole_pages:
        # Pages strided by more than their bytes (cross-layer blocks): one
        # descriptor per page (merged again where both sides touch).
        src_p, dst_p = _expand_runs(runs)
        src_off, dst_off = src_p * src.page_stride, dst_p * dst.page_stride
        lengths = np.full(src_p.size, src.page_bytes, dtype=np.int64)
    elif src.page_layout is PageLayout.HND:
        # Head-major pages: a head slice of a page is one block of
        # heads x page_size x head bytes; consecutive pages are separated by
        # the other heads, so one descriptor per page.
        src_p, dst_p = _expand_runs(runs)
        head_block = src.page_size * src.head_bytes
        src_off = src_p * src.page_stride + src_head_offset * head_block
        dst_off = dst_p * dst.page_stride + dst_head_offset * head_block
        lengths = np.full(src_p.size, heads * head_block, dtype=np.int64)
    else:
        # Token-major pages: a head slice is strided, one descriptor per token.
        tokens = runs.lengths * src.page_size
        first = np.repeat(np.cumsum(tokens) - tokens, tokens)
        tok = np.arange(int(tokens.sum())) - first  # token index from its run's first page
        src_page = np.repeat(runs.src_starts, tokens) + tok // src.page_size
        dst_page = np.repeat(runs.dst_starts, tokens) + tok // src.page_size
        in_page = tok % src.page_size
        head_bytes = src.head_bytes
        src_off = src_page * src.page_stride + in_page * src.token_bytes + src_head_offset * head_bytes
        dst_off = dst_page * dst.page_stride + in_page * dst.token_bytes + dst_head_offset * head_bytes
        lengths = np.full(tok.size, heads * head_bytes, dtype=np.int64)
    src_bases, dst_bases = [], []
    for layer in layers:
        for comp in src.components:
            src_bases.append(src.buffer(layer, comp).addr)
            dst_bases.append(dst.buffer(layer, comp).addr)
    src_b = np.asarray(src_bases, dtype=_U64)[:, None]
    dst_b = np.asarray(dst_bases, dtype=_U64)[:, None]
    n = len(src_bases)
    plan = TransferPlan(
        (src_b + src_off.astype(_U64)[None, :]).ravel(),
        (dst_b + dst_off.astype(_U64)[None, :]).ravel(),
        np.broadcast_to(lengths.astype(_U64), (n, lengths.size)).ravel().copy(),
    )
    return coalesce(plan)


def _expand_runs(runs: PageRuns) -> tuple[np.ndarray, np.ndarray]:
    """Every page of the runs, source and destination ids."""
    first = np.repeat(np.cumsum(runs.lengths) - runs.lengths, runs.lengths)
    step = np.arange(int(runs.lengths.sum())) - first
    return np.repeat(runs.src_starts, runs.lengths) + step, np.repeat(runs.dst_starts, runs.lengths) + step


@dataclass(frozen=True)
class PageSlice:
    """The bytes of each page of one buffer that a transfer takes: ``rows``
    rows of ``row_bytes``, and of each row ``nbytes`` from ``start``.
    Packed, a page's slice is ``rows * nbytes`` bytes."""

    rows: int
    row_bytes: int
    start: int
    nbytes: int

    @property
    def packed_bytes(self) -> int:
        return self.rows * self.nbytes


def page_slice(pool: PoolDescriptor, head_offset: int, num_heads: int) -> PageSlice:
    """What a head slice of a page is in this pool's memory layout."""
    if num_heads == pool.num_kv_heads:
        return PageSlice(1, pool.page_bytes, 0, pool.page_bytes)
    head_bytes = pool.head_bytes
    if pool.page_layout is PageLayout.HND:
        block = pool.page_size * head_bytes
        return PageSlice(1, pool.page_bytes, head_offset * block, num_heads * block)
    return PageSlice(pool.page_size, pool.token_bytes, head_offset * head_bytes, num_heads * head_bytes)


def staged_bytes(pool: PoolDescriptor, sl: PageSlice, num_pages: int, num_layers: int | None = None) -> int:
    """Bytes of ``num_pages`` pages of ``pool`` packed for staging (each
    buffer's slice ``sl`` of each page, buffer by buffer): of every layer, or
    of ``num_layers`` of them (a layer group's share)."""
    layers = pool.num_layers if num_layers is None else num_layers
    return num_pages * sl.packed_bytes * layers * len(pool.components)


def plan_aux(src: AuxDescriptor, dst: AuxDescriptor, src_slot: int, dst_slot: int) -> TransferPlan:
    """Plan moving one metadata row."""
    if src.slot_bytes != dst.slot_bytes:
        raise ValueError(f"aux slot sizes differ: {src.slot_bytes} vs {dst.slot_bytes}")
    if not 0 <= src_slot < src.num_slots:
        raise IndexError(f"aux index {src_slot} outside the source's {src.num_slots} slots")
    if not 0 <= dst_slot < dst.num_slots:
        raise IndexError(f"aux index {dst_slot} outside the destination's {dst.num_slots} slots")
    return TransferPlan(
        np.asarray([src.addr + src_slot * src.slot_bytes], dtype=_U64),
        np.asarray([dst.addr + dst_slot * dst.slot_bytes], dtype=_U64),
        np.asarray([src.slot_bytes], dtype=_U64),
    )


def plan_aux_regions(src: list[AuxDescriptor] | tuple[AuxDescriptor, ...],
                     dst: list[AuxDescriptor] | tuple[AuxDescriptor, ...], src_slot: int, dst_slot: int) -> TransferPlan:
    """Plan moving one request slot's row of every aux region (SGLang keeps
    about 13 metadata buffers that share one row index): region ``i`` of
    ``src`` goes to region ``i`` of ``dst``, one descriptor each."""
    if len(src) != len(dst):
        raise ValueError(f"aux regions differ in number: {len(src)} vs {len(dst)}")
    plans = []
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        try:
            plans.append(plan_aux(s, d, src_slot, dst_slot))
        except (ValueError, IndexError) as exc:
            raise type(exc)(f"aux region {i}: {exc}") from None
    return TransferPlan.concat(plans)


def pair_state_items(pool: StatePoolDescriptor, src_items, dst_items) -> tuple[np.ndarray, np.ndarray]:
    """A request's prefill and decode item indices of one state pool, paired
    position by position: equally long for an ``exact`` pool (else
    ValueError naming both lengths), the longer cut to the shorter for a
    page-indexed one. A negative index is a position that side does not
    hold (a sliding window's blocks before the window): decode's are not
    moved; one of prefill's where decode wants the item is a ValueError
    naming the position (never a silent gap)."""
    src = np.asarray(src_items, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_items, dtype=np.int64).reshape(-1)
    if src.size != dst.size:
        if pool.exact:
            raise ValueError(f"state {pool.kind}: prefill names {src.size} item(s), decode {dst.size}; this state "
                             "is slot- or row-indexed and must match item for item")
        n = min(src.size, dst.size)
        src, dst = src[:n], dst[:n]
    wanted = dst >= 0
    if not wanted.all() or (src < 0).any():
        missing = np.flatnonzero(wanted & (src < 0))
        if missing.size:
            raise ValueError(f"state {pool.kind}: decode wants item position(s) {missing[:8].tolist()} "
                             f"({missing.size} in all) that prefill does not hold")
        src, dst = src[wanted], dst[wanted]
    return src, dst


def check_state(src: StatePoolDescriptor, dst: StatePoolDescriptor, src_items: np.ndarray,
                dst_items: np.ndarray) -> None:
    """What moving items of a state pool must respect, checked before any byte
    moves (direct and staged alike): the same kind and buffers, every index
    inside both sides' buffers (item sizes: at the handshake, and by the
    row blocks). Raises ValueError or IndexError."""
    if src.kind != dst.kind or len(src.buffers) != len(dst.buffers):
        raise ValueError(f"state {src.kind} ({len(src.buffers)} buffers) vs {dst.kind} ({len(dst.buffers)} buffers)")
    check_pages(src_items, src.num_items, f"state {src.kind} (source)")
    check_pages(dst_items, dst.num_items, f"state {dst.kind} (destination)")


def plan_state(src: StatePoolDescriptor, dst: StatePoolDescriptor, src_items, dst_items, blocks=None) -> TransferPlan:
    """Plan moving state items (already paired, :func:`pair_state_items`):
    item ``src_items[i]`` of each buffer to item ``dst_items[i]`` of the
    same buffer on the other side. ``blocks``: per buffer, what this rank
    sends of an item (a :class:`~transfer.state_slices.RowBlocks`, for a
    sharded state between different TP sizes); None: whole items, runs of
    items consecutive on both sides as one descriptor per buffer."""
    src_items = np.asarray(src_items, dtype=np.int64).reshape(-1)
    dst_items = np.asarray(dst_items, dtype=np.int64).reshape(-1)
    check_state(src, dst, src_items, dst_items)
    if src_items.size == 0:
        return TransferPlan.empty()
    plans = []
    if blocks is not None:
        for s, d, rb in zip(src.buffers, dst.buffers, blocks, strict=True):
            so, n = block_entries(rb, src_items, s.item_bytes)
            do, _ = block_entries(rb, dst_items, d.item_bytes, dst=True)
            plans.append(TransferPlan(_U64(s.addr) + so.astype(_U64), _U64(d.addr) + do.astype(_U64), n.astype(_U64)))
        return coalesce(TransferPlan.concat(plans))
    runs = page_runs(src_items, dst_items)
    for s, d in zip(src.buffers, dst.buffers, strict=True):
        if s.item_bytes != d.item_bytes:
            raise ValueError(f"state {src.kind}: items of {s.item_bytes} vs {d.item_bytes} bytes")
        n = _U64(s.item_bytes)
        plans.append(TransferPlan(_U64(s.addr) + runs.src_starts.astype(_U64) * n,
                                  _U64(d.addr) + runs.dst_starts.astype(_U64) * n,
                                  runs.lengths.astype(_U64) * n))
    return TransferPlan.concat(plans)


def split_entries(plan: TransferPlan, max_bytes: int) -> TransferPlan:
    """Cut entries longer than ``max_bytes`` into pieces of at most that size,
    so one huge entry does not sit on one engine lane while the others idle."""
    if plan.num_descriptors == 0 or int(plan.lengths.max()) <= max_bytes:
        return plan
    pieces = (plan.lengths + _U64(max_bytes - 1)) // _U64(max_bytes)
    idx = np.repeat(np.arange(plan.num_descriptors), pieces.astype(np.int64))
    first = np.repeat(np.cumsum(pieces) - pieces, pieces.astype(np.int64))
    k = (np.arange(idx.size, dtype=_U64) - first.astype(_U64))
    offset = k * _U64(max_bytes)
    lengths = np.minimum(plan.lengths[idx] - offset, _U64(max_bytes))
    return TransferPlan(plan.src_addrs[idx] + offset, plan.dst_addrs[idx] + offset, lengths)


def coalesce(plan: TransferPlan) -> TransferPlan:
    """Merge neighbouring entries that are contiguous on both sides."""
    if plan.num_descriptors < 2:
        return plan
    s, d, n = plan.src_addrs, plan.dst_addrs, plan.lengths
    joins = (s[:-1] + n[:-1] == s[1:]) & (d[:-1] + n[:-1] == d[1:])
    if not joins.any():
        return plan
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return TransferPlan(s[starts], d[starts], np.add.reduceat(n, starts))


@dataclass(frozen=True)
class StridedPages:
    """Head-major fused pages with an explicit page stride (vLLM's layouts).

    Page ``p`` of layer ``l`` starts at ``layer_addrs[l] + p *
    page_stride_bytes`` and holds ``num_heads`` head blocks of
    ``head_block_bytes`` each, one after another (a head's K and V together,
    as vLLM's CPU backend keeps them). Per-layer buffers (``LBHNC``) have a
    stride of one page; cross-layer blocks (``BLHNC``: every layer's page of
    block ``p`` side by side) have ``layer_addrs[l] = base + l * page_bytes``
    and a stride of ``num_layers * page_bytes``.
    """

    layer_addrs: tuple[int, ...]
    num_pages: int
    page_stride_bytes: int
    num_heads: int
    head_block_bytes: int

    def __post_init__(self) -> None:
        if not self.layer_addrs or self.num_pages < 1 or self.num_heads < 1 or self.head_block_bytes < 1:
            raise ValueError("StridedPages: need layers, pages, heads and head bytes")
        if self.page_stride_bytes < self.page_bytes:
            raise ValueError(f"StridedPages: page stride {self.page_stride_bytes} below the page's "
                             f"{self.page_bytes} bytes")

    @property
    def page_bytes(self) -> int:
        return self.num_heads * self.head_block_bytes


def plan_strided(src: StridedPages, dst: StridedPages, src_pages, dst_pages, *, src_head_offset: int = 0,
                 dst_head_offset: int = 0, num_heads: int | None = None) -> TransferPlan:
    """Plan moving pages (or a head slice of each page, for heterogeneous TP)
    between two strided layouts, layer by layer; the layouts may differ in
    stride (cross-layer to per-layer is a plan like any other)."""
    src_pages = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    dst_pages = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    if len(src.layer_addrs) != len(dst.layer_addrs) or src.head_block_bytes != dst.head_block_bytes:
        raise ValueError("strided pages: layer counts and head block bytes must match")
    check_pages(src_pages, src.num_pages, "strided pages (source)")
    check_pages(dst_pages, dst.num_pages, "strided pages (destination)")
    heads = src.num_heads if num_heads is None else num_heads
    if heads < 1 or min(src_head_offset, dst_head_offset) < 0 or src_head_offset + heads > src.num_heads \
            or dst_head_offset + heads > dst.num_heads:
        raise ValueError(f"strided pages: head slice of {heads} at {src_head_offset} -> {dst_head_offset} outside "
                         f"{src.num_heads} -> {dst.num_heads} heads")
    runs = page_runs(src_pages, dst_pages)
    if runs.lengths.size == 0:
        return TransferPlan.empty()
    src_p, dst_p = _expand_runs(runs)
    src_off = src_p * src.page_stride_bytes + src_head_offset * src.head_block_bytes
    dst_off = dst_p * dst.page_stride_bytes + dst_head_offset * dst.head_block_bytes
    lengths = np.full(src_p.size, heads * src.head_block_bytes, dtype=np.int64)
    src_b = np.asarray(src.layer_addrs, dtype=_U64)[:, None]
    dst_b = np.asarray(dst.layer_addrs, dtype=_U64)[:, None]
    n = len(src.layer_addrs)
    return coalesce(TransferPlan(
        (src_b + src_off.astype(_U64)[None, :]).ravel(),
        (dst_b + dst_off.astype(_U64)[None, :]).ravel(),
        np.broadcast_to(lengths.astype(_U64), (n, lengths.size)).ravel().copy(),
    ))
