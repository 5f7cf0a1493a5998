"""Which prefill rank sends which bytes of a state item to a decode rank. Pure.

A replicated state (the same on every TP rank) comes whole from one prefill
rank. A sharded one moves rank to rank between equal TP sizes; between
different sizes each item is cut along its slice axis
(:class:`~bootstrap.messages.StateBuffer`: ``slice_outer`` rows of
``slice_dim`` units, the axis split into ``slice_groups`` sub-blocks, each
divided over the ranks on its own), as SGLang's own backends slice a
sliding-window page by KV heads or a Mamba state by heads and conv channels:
every decode rank gets, from each prefill rank whose share overlaps its
own, the overlap, sub-block by sub-block and row by row. A buffer without a
slice axis inside a sharded state (an item the same on every rank) comes
whole from the first of those prefill ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bootstrap.messages import StateBuffer, StatePoolDescriptor, StateSharding


@dataclass(frozen=True)
class RowBlocks:
    """What one prefill rank sends of each item of one buffer: in each of
    ``rows`` rows (``src_row`` / ``dst_row`` bytes apart on the two sides),
    the blocks ``(src_offset, dst_offset, nbytes)`` (offsets within the row).
    No blocks: nothing of this buffer from this rank."""

    rows: int
    src_row: int
    dst_row: int
    blocks: tuple[tuple[int, int, int], ...]

    @property
    def item_bytes(self) -> int:
        """Bytes sent per item (packed: block by block, each ``rows`` x its bytes)."""
        return self.rows * sum(n for _, _, n in self.blocks)


def senders(pool: StatePoolDescriptor, aux_rank: int, prefill_tp: int, decode_rank: int,
            decode_tp: int) -> tuple[int, ...]:
    """The prefill ranks that send state ``pool`` to decode rank
    ``decode_rank``: the aux row's sender for a replicated state; for a
    sharded one, the prefill ranks whose share of the slice axis overlaps
    the decode rank's (its own TP rank between equal sizes)."""
    if pool.sharding is StateSharding.REPLICATED:
        return (aux_rank,)
    if prefill_tp == decode_tp:
        return (decode_rank,)
    if prefill_tp > decode_tp:
        k = prefill_tp // decode_tp
        return tuple(range(decode_rank * k, decode_rank * k + k))
    return (decode_rank * prefill_tp // decode_tp,)


def check_slices(src: StateBuffer, dst: StateBuffer, prefill_tp: int, decode_tp: int, what: str) -> None:
    """Raise ValueError unless buffer ``src`` (on a prefill rank) and ``dst``
    (on a decode rank) of a sharded state can be resliced between the TP
    sizes: both with a slice axis of the same rows, unit and sub-blocks,
    covering the same whole axis, each sub-block divisible by both sizes
    (or both without one, items of one size)."""
    if prefill_tp == decode_tp or (src.slice_dim == 0 and dst.slice_dim == 0):
        if src.item_bytes != dst.item_bytes:
            raise ValueError(f"{what}: items of {src.item_bytes} vs {dst.item_bytes} bytes")
        return
    if not src.slice_dim or not dst.slice_dim:
        raise ValueError(f"{what}: a slice axis on one side only (slice_dim {src.slice_dim} vs {dst.slice_dim})")
    if (src.slice_outer, src.unit_bytes) != (dst.slice_outer, dst.unit_bytes):
        raise ValueError(f"{what}: rows x unit bytes {src.slice_outer} x {src.unit_bytes} vs "
                         f"{dst.slice_outer} x {dst.unit_bytes}")
    total = src.slice_dim * prefill_tp
    if dst.slice_dim * decode_tp != total:
        raise ValueError(f"{what}: the slice axis holds {total} units over prefill's {prefill_tp} ranks, "
                         f"{dst.slice_dim * decode_tp} over decode's {decode_tp}")
    groups = src.slice_groups or (total,)
    if tuple(dst.slice_groups or (total,)) != tuple(groups) or sum(groups) != total:
        raise ValueError(f"{what}: slice sub-blocks {list(src.slice_groups)} vs {list(dst.slice_groups)} "
                         f"(the axis holds {total} units)")
    for g in groups:
        if g % prefill_tp or g % decode_tp:
            raise ValueError(f"{what}: a sub-block of {g} units does not split over {prefill_tp} and {decode_tp} ranks")


def row_blocks(src: StateBuffer, dst: StateBuffer, prefill_rank: int, prefill_tp: int, decode_rank: int,
               decode_tp: int, first_sender: bool) -> RowBlocks:
    """What prefill rank ``prefill_rank`` sends of each item of this buffer
    to decode rank ``decode_rank`` (see the module docstring; checked by
    :func:`check_slices`). ``first_sender``: it is the first of the
    decode rank's senders of this state (it alone sends buffers without a
    slice axis)."""
    check_slices(src, dst, prefill_tp, decode_tp, "state buffer")
    if prefill_tp == decode_tp:
        return RowBlocks(1, src.item_bytes, dst.item_bytes, ((0, 0, src.item_bytes),))
    if src.slice_dim == 0:
        blocks = ((0, 0, src.item_bytes),) if first_sender else ()
        return RowBlocks(1, src.item_bytes, dst.item_bytes, blocks)
    unit = src.unit_bytes
    blocks = []
    src_off = dst_off = 0
    for g in src.slice_groups or (src.slice_dim * prefill_tp,):
        s_sub, d_sub = g // prefill_tp, g // decode_tp
        lo = max(prefill_rank * s_sub, decode_rank * d_sub)
        hi = min((prefill_rank + 1) * s_sub, (decode_rank + 1) * d_sub)
        if hi > lo:
            blocks.append(((src_off + lo - prefill_rank * s_sub) * unit, (dst_off + lo - decode_rank * d_sub) * unit,
                           (hi - lo) * unit))
        src_off += s_sub
        dst_off += d_sub
    return RowBlocks(src.slice_outer, src.slice_dim * unit, dst.slice_dim * unit, tuple(_merged(blocks)))


def _merged(blocks: list) -> list:
    out = []
    for so, do, n in blocks:
        if out and out[-1][0] + out[-1][2] == so and out[-1][1] + out[-1][2] == do:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((so, do, n))
    return out


def block_entries(rb: RowBlocks, items: np.ndarray, item_bytes: int, *, dst: bool = False) -> tuple[np.ndarray, ...]:
    """Byte offsets (from the buffer's start) and lengths of ``rb``'s blocks
    of ``items``, in the packed order (block by block, item by item, row by
    row); ``dst``: the destination side's offsets."""
    items = np.asarray(items, dtype=np.int64).reshape(-1)
    row = rb.dst_row if dst else rb.src_row
    offs, lens = [], []
    for so, do, n in rb.blocks:
        base = items[:, None] * item_bytes + np.arange(rb.rows, dtype=np.int64)[None, :] * row + (do if dst else so)
        offs.append(base.reshape(-1))
        lens.append(np.full(base.size, n, dtype=np.int64))
    if not offs:
        e = np.zeros(0, dtype=np.int64)
        return e, e
    return np.concatenate(offs), np.concatenate(lens)
