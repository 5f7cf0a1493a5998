"""Staging copies: gather scattered pages into one registered buffer, send it
as a few large descriptors, scatter it on the other side.

On TCP every descriptor costs about 30 us whatever its size, so a
layer-first pool with scattered pages (one 32 KiB descriptor per page, layer
and K/V) moves at a fraction of the link; a memcpy is several times faster
than the link here, and HBM far more so on GPUs. Both sides keep a
registered staging tensor on the pools' device; a staged chunk is packed
buffer by buffer (the pool's canonical (layer, component) order), page by
page, each page's :class:`~transfer.plan.PageSlice`.

:class:`~transfer.staging.area.StagingArea` hands out regions of it.
``gather`` and ``scatter`` run torch index ops on uint8 views of the pool
tensors: no Python loop over pages, and the same code on CPU or CUDA.

On CUDA they run on a private stream per device (:func:`copy_stream`), and
wait for that stream only before returning (the engine reads, or decode
reports, right after): never for the device, so kernels the scheduler
queued elsewhere do not hold them up. Page ids reach the device through
:func:`page_tensor` (pinned, ``non_blocking``, on the same stream). The
order after the KV's producer is the caller's: the sender's ``ready``
event, waited for before the gather (:mod:`transfer.ready`).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from bootstrap.messages import PoolDescriptor
from transfer.plan import PageSlice

_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word(sl: PageSlice, *addrs: int) -> tuple[int, torch.dtype]:
    """The widest element that divides the slice: torch's index kernels copy
    element by element, and 8-byte elements run about 5x faster than bytes."""
    for width, dtype in _WIDE:
        if all(x % width == 0 for x in (sl.row_bytes, sl.start, sl.nbytes, *addrs)):
            return width, dtype
    return 1, torch.uint8


def _rows(t: torch.Tensor, num_pages: int, sl: PageSlice, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A pool tensor as [num_pages, rows, nbytes / width] words: the slice of each page.
    A tensor whose pages are strided (cross-layer blocks) is viewed, never copied."""
    if t.is_contiguous():
        words = t.reshape(-1).view(torch.uint8).view(dtype).view(num_pages, sl.rows, sl.row_bytes // width)
    else:  # [num_pages, ...]: each page contiguous, pages a stride apart
        words = t.view(torch.uint8).view(num_pages, -1).view(dtype).view(num_pages, sl.rows, sl.row_bytes // width)
    return words[:, :, sl.start // width:(sl.start + sl.nbytes) // width]


class _PoolWords:
    """One pool's buffers as word views of one page slice each (packing
    order), with numpy twins on CPU. Built once per (pool, slice, word) and
    kept in the owner's cache: building views costs about half as much as
    the copy of a staging part itself.

    ``every``: when the buffers lie in one allocation a fixed stride apart
    (a pool allocated as one tensor, as vLLM's are), all of them as one view
    [buffers, pages, rows, words], so that a part is gathered or scattered
    in one native call. Each call gives up the interpreter lock and must
    take it back: behind a busy thread that costs up to a switch interval
    (5 ms) per call, per buffer when the buffers lie apart."""

    def __init__(self, tensors: dict, pool: PoolDescriptor, sl: PageSlice, width: int, dtype: torch.dtype) -> None:
        bufs = [tensors[(pool.role, layer, comp)] for layer in range(pool.num_layers)
                for comp in pool.components]
        self.width, self.dtype = width, dtype
        self.rows = [_rows(t, pool.num_pages, sl, width, dtype) for t in bufs]
        self.every = _one_view(self.rows, width)
        cpu = bool(bufs) and bufs[0].device.type == "cpu"
        self.arrays = [r.numpy() for r in self.rows] if cpu else None
        self.every_array = self.every.numpy() if cpu and self.every is not None else None


def _one_view(rows: list[torch.Tensor], width: int) -> torch.Tensor | None:
    """``rows`` (equal views of one storage, each ``step`` bytes after the
    last) as one view [len(rows), ...]; None when they are not so."""
    if len(rows) < 2:
        return None
    first = rows[0]
    step = rows[1].data_ptr() - first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    if step <= 0 or step % width:
        return None
    for i, r in enumerate(rows):
        if r.untyped_storage().data_ptr() != storage or r.data_ptr() - first.data_ptr() != i * step \
                or r.shape != first.shape or r.stride() != first.stride():
            return None
    return first.as_strided((len(rows), *first.shape), (step // width, *first.stride()), first.storage_offset())


def _pool_words(staging: torch.Tensor, offset: int, tensors: dict, pool: PoolDescriptor, sl: PageSlice,
                cache: dict | None) -> _PoolWords:
    """The widest word that divides the slice, every buffer's address and
    the staging offset, and the pool's views in it."""
    addrs = cache.get(("addrs", pool.role)) if cache is not None else None
    if addrs is None:
        addrs = tuple(tensors[(pool.role, layer, comp)].data_ptr() for layer in range(pool.num_layers)
                      for comp in pool.components)
        if cache is not None:
            cache[("addrs", pool.role)] = addrs
    width, dtype = _word(sl, staging.data_ptr() + offset, *addrs)
    key = (pool.role, sl, width)
    words = cache.get(key) if cache is not None else None
    if words is None:
        words = _PoolWords(tensors, pool, sl, width, dtype)
        if cache is not None:
            cache[key] = words
    return words


def _packed(staging: torch.Tensor, offset: int, words: _PoolWords, sl: PageSlice, n: int,
            count: int | None = None) -> torch.Tensor:
    """The staging region of a pool's part: [buffers, pages, rows, words]
    (``count`` buffers; None: all of the pool's)."""
    count = len(words.rows) if count is None else count
    nbytes = count * n * sl.packed_bytes
    return staging[offset:offset + nbytes].view(words.dtype).view(count, n, sl.rows, sl.nbytes // words.width)


def gather(staging: torch.Tensor, offset: int, tensors: dict, pool: PoolDescriptor, sl: PageSlice,
           pages: torch.Tensor, cache: dict | None = None, layers=None) -> int:
    """Pack ``pages`` of every buffer of ``pool`` into ``staging[offset:]``;
    returns the bytes written. ``cache`` (owned by whoever owns ``tensors``)
    keeps the pool's word views between calls. ``layers`` (the pool's layer
    indices, ascending; None: all): only those layers' buffers, packed one
    after the other."""
    words = _pool_words(staging, offset, tensors, pool, sl, cache)
    spans = _buffer_runs(pool, layers)
    count = sum(n for _, n in spans)
    packed = _packed(staging, offset, words, sl, pages.numel(), count)
    with _on_copy_stream(staging):
        at = 0
        for first, n in spans:
            if words.every is not None:
                torch.index_select(words.every[first:first + n], 1, pages, out=packed[at:at + n])
            else:
                for i in range(n):
                    torch.index_select(words.rows[first + i], 0, pages, out=packed[at + i])
            at += n
    _sync(staging)
    return count * pages.numel() * sl.packed_bytes


def _buffer_runs(pool: PoolDescriptor, layers) -> list[tuple[int, int]]:
    """The pool's buffers (in (layer, component) order) of ``layers``
    (ascending; None: all) as (first, count) runs of consecutive ones."""
    comps = len(pool.components)
    if layers is None:
        return [(0, pool.num_layers * comps)]
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][0] + runs[-1][1] == layer * comps:
            runs[-1][1] += comps
        else:
            runs.append([layer * comps, comps])
    return [(a, n) for a, n in runs]


def scatter(staging: torch.Tensor, offset: int, tensors: dict, pool: PoolDescriptor, sl: PageSlice,
            pages: torch.Tensor, cache: dict | None = None, layers=None, in_place: bool = False) -> int:
    """Unpack what :func:`gather` packed into ``pages`` of this side's pool;
    returns the bytes read (where the next pool's packing starts).
    ``layers`` (the pool's layer indices, ascending; None: all): only those
    layers' buffers, packed one after the other as :func:`gather` packs
    them, or, ``in_place``, each at its place in the whole pool's packing
    (then the whole packing's bytes count as read)."""
    words = _pool_words(staging, offset, tensors, pool, sl, cache)
    runs = _buffer_runs(pool, layers)
    if in_place or layers is None:
        packed, spans = _packed(staging, offset, words, sl, pages.numel()), [(f, n, f) for f, n in runs]
    else:
        count = sum(n for _, n in runs)
        packed = _packed(staging, offset, words, sl, pages.numel(), count)
        spans = [(f, n, sum(m for _, m in runs[:i])) for i, (f, n) in enumerate(runs)]
    if words.arrays is not None:
        # numpy's row assignment copies whole rows with memcpy: about 4x
        # torch's index_copy_ on CPU, writing through the same memory.
        index, src = pages.numpy(), packed.numpy()
        for first, n, at in spans:  # buffers first.. of the pool, from packed position at..
            if words.every_array is not None:
                words.every_array[first:first + n][:, index] = src[at:at + n]
            else:
                for i in range(n):
                    words.arrays[first + i][index] = src[at + i]
    else:
        with _on_copy_stream(staging):
            for first, n, at in spans:
                if words.every is not None:
                    words.every[first:first + n].index_copy_(1, pages, packed[at:at + n])
                else:
                    for i in range(n):
                        words.rows[first + i].index_copy_(0, pages, packed[at + i])
    _sync(staging)
    return packed.shape[0] * pages.numel() * sl.packed_bytes


def _block_views(rows, blocks, *, dst: bool):
    """(view, rows, bytes) per block of each buffer: the buffer ``uint8
    [num_items, item_bytes]`` viewed ``[num_items, rows, row bytes]`` and cut
    to the block's bytes of each row (no copy), in the packed order."""
    for r, rb in zip(rows, blocks, strict=True):
        row = rb.dst_row if dst else rb.src_row
        shaped = r[:, :rb.rows * row].view(r.shape[0], rb.rows, row)
        for so, do, n in rb.blocks:
            off = do if dst else so
            yield shaped[:, :, off:off + n], rb.rows, n


def gather_state(staging: torch.Tensor, offset: int, rows, items: torch.Tensor, blocks) -> int:
    """Pack ``items`` of every state buffer (``rows``: each ``uint8
    [num_items, item_bytes]``, :func:`transfer.state_pools.state_rows`) into
    ``staging[offset:]``: buffer by buffer, each of its ``blocks``
    (:class:`~transfer.state_slices.RowBlocks`) block by block, item by item,
    row by row. Returns the bytes written."""
    k, total = items.numel(), 0
    with _on_copy_stream(staging):
        for view, nrows, n in _block_views(rows, blocks, dst=False):
            size = k * nrows * n
            torch.index_select(view, 0, items, out=staging[offset + total:offset + total + size].view(k, nrows, n))
            total += size
    _sync(staging)
    return total


def scatter_state(staging: torch.Tensor, offset: int, rows, items: torch.Tensor, blocks) -> int:
    """Unpack what :func:`gather_state` packed into ``items`` of this side's
    state buffers (``blocks``: the same, with this side's offsets)."""
    k, total = items.numel(), 0
    with _on_copy_stream(staging):
        for view, nrows, n in _block_views(rows, blocks, dst=True):
            size = k * nrows * n
            view.index_copy_(0, items, staging[offset + total:offset + total + size].view(k, nrows, n))
            total += size
    _sync(staging)
    return total


_streams: dict = {}  # device -> its private copy stream
_streams_lock = threading.Lock()


def copy_stream(device: torch.device):
    """The private CUDA stream that staging copies of ``device`` run on
    (created once per device; None for the CPU)."""
    if device.type != "cuda":
        return None
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)
        return stream


class _on_copy_stream:
    """``with``: run the block's torch ops on the tensor's copy stream (a
    no-op on the CPU)."""

    def __init__(self, t: torch.Tensor) -> None:
        stream = copy_stream(t.device)
        self._ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def page_tensor(pages: np.ndarray, device: torch.device) -> torch.Tensor:
    """Page ids as an int64 tensor on ``device``: on CUDA a pinned host copy
    sent ``non_blocking`` on the copy stream, so it queues behind nothing
    else; the gather or scatter that uses it runs on that stream too, and
    its final synchronisation keeps the pinned copy alive long enough."""
    host = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
    stream = copy_stream(device)
    if stream is None:
        return host
    with torch.cuda.stream(stream):
        return host.pin_memory().to(device, non_blocking=True)


def _sync(t: torch.Tensor) -> None:
    stream = copy_stream(t.device)
    if stream is not None:  # the engine reads and writes device memory after we return
        stream.synchronize()


def _aux_rows(aux) -> list:
    """Each aux region (one tensor, or a sequence of them) as uint8 rows."""
    regions = aux if isinstance(aux, (tuple, list)) else (aux,)
    return [t.reshape(t.shape[0], -1).view(torch.uint8) for t in regions]


def aux_row(aux, slot: int) -> bytes:
    """The bytes of one aux row: slot ``slot`` of every region (each
    [num_slots, ...], contiguous), back to back."""
    return b"".join(rows[slot].cpu().numpy().tobytes() for rows in _aux_rows(aux))


def write_aux_row(aux, slot: int, row: bytes) -> None:
    """Write one aux row (what :func:`aux_row` read on the other side)."""
    offset = 0
    for rows in _aux_rows(aux):
        n = rows.shape[1]
        rows[slot].copy_(torch.frombuffer(bytearray(row[offset:offset + n]), dtype=torch.uint8))
        offset += n
