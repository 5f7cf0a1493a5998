"""Staging: gather scattered pages into one registered buffer, send it as a
few large descriptors, scatter it on the other side.

On TCP every descriptor costs about 30 us whatever its size, so a
layer-first pool with scattered pages (one 32 KiB descriptor per page, layer
and K/V) moves at a fraction of the link; a memcpy is several times faster
than the link here, and HBM far more so on GPUs. Both sides keep a
registered staging tensor on the pools' device; a staged chunk is packed
buffer by buffer (the pool's canonical (layer, component) order), page by
page, each page's :class:`~transfer.plan.PageSlice`.

:class:`StagingArea` hands out regions of it (first fit, freed explicitly).
``gather`` and ``scatter`` run torch index ops on uint8 views of the pool
tensors: no Python loop over pages, and the same code on CPU or CUDA.
"""

from __future__ import annotations

import threading

import torch

from bootstrap.messages import PoolDescriptor, components_of
from transfer.plan import PageSlice


class StagingArea:
    """First-fit allocator over ``nbytes`` of staging memory, 4 KiB aligned.
    Thread-safe. ``alloc`` returns an offset or None when no region fits."""

    ALIGN = 4096

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, size)
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        with self._lock:
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, free - size)
                    return off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        with self._lock:
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, n in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((off, n))
            self._free = merged

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)


_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word(sl: PageSlice, *addrs: int) -> tuple[int, torch.dtype]:
    """The widest element that divides the slice: torch's index kernels copy
    element by element, and 8-byte elements run about 5x faster than bytes."""
    for width, dtype in _WIDE:
        if all(x % width == 0 for x in (sl.row_bytes, sl.start, sl.nbytes, *addrs)):
            return width, dtype
    return 1, torch.uint8


def _rows(t: torch.Tensor, num_pages: int, sl: PageSlice, width: int, dtype: torch.dtype) -> torch.Tensor:
    """A pool tensor as [num_pages, rows, nbytes / width] words: the slice of each page."""
    words = t.reshape(-1).view(torch.uint8).view(dtype).view(num_pages, sl.rows, sl.row_bytes // width)
    return words[:, :, sl.start // width:(sl.start + sl.nbytes) // width]


def staged_bytes(pool: PoolDescriptor, sl: PageSlice, num_pages: int) -> int:
    return num_pages * sl.packed_bytes * pool.num_layers * len(components_of(pool.attention))


def _pairs(staging: torch.Tensor, offset: int, tensors: dict, pool: PoolDescriptor, sl: PageSlice, n: int,
           cache: dict | None = None):
    """For each buffer of ``pool`` in packing order: (its page slices as
    words, the packed region of ``staging`` that holds them). ``cache``
    (owned by whoever owns ``tensors``) keeps the word views of the pool
    tensors: building them costs about half as much as the copy itself."""
    per_buffer = n * sl.packed_bytes
    for layer in range(pool.num_layers):
        for comp in components_of(pool.attention):
            key = (pool.role, layer, comp)
            t = tensors[key]
            width, dtype = _word(sl, t.data_ptr(), staging.data_ptr() + offset)
            packed = staging[offset:offset + per_buffer].view(dtype).view(n, sl.rows, sl.nbytes // width)
            if cache is None:
                rows = _rows(t, pool.num_pages, sl, width, dtype)
            else:
                rows = cache.get((key, sl, width))
                if rows is None:
                    rows = cache[(key, sl, width)] = _rows(t, pool.num_pages, sl, width, dtype)
            yield rows, packed
            offset += per_buffer


def gather(staging: torch.Tensor, offset: int, tensors: dict, pool: PoolDescriptor, sl: PageSlice,
           pages: torch.Tensor, cache: dict | None = None) -> int:
    """Pack ``pages`` of every buffer of ``pool`` into ``staging[offset:]``;
    returns the bytes written."""
    for rows, packed in _pairs(staging, offset, tensors, pool, sl, pages.numel(), cache):
        torch.index_select(rows, 0, pages, out=packed)
    _sync(staging)
    return staged_bytes(pool, sl, pages.numel())


def scatter(staging: torch.Tensor, offset: int, tensors: dict, pool: PoolDescriptor, sl: PageSlice,
            pages: torch.Tensor, cache: dict | None = None) -> int:
    """Unpack what :func:`gather` packed into ``pages`` of this side's pool."""
    on_cpu = staging.device.type == "cpu"
    index = pages.numpy() if on_cpu else pages
    for rows, packed in _pairs(staging, offset, tensors, pool, sl, pages.numel(), cache):
        if on_cpu:
            # numpy's row assignment copies whole rows with memcpy: about 4x
            # torch's index_copy_ on CPU, writing through the same memory.
            rows.numpy()[index] = packed.numpy()
        else:
            rows.index_copy_(0, pages, packed)
    _sync(staging)
    return staged_bytes(pool, sl, pages.numel())


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:  # the engine reads and writes device memory after we return
        torch.cuda.current_stream(t.device).synchronize()
