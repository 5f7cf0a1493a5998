"""A rank's staging memory: the registered tensor, the allocator of its
regions, and the pool tensors that staged parts are gathered from and
scattered into (see :mod:`transfer.staging.copies`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from bootstrap.messages import StagingDescriptor
from transfer.staging.copies import gather, gather_state, page_tensor
from transfer.state_pools import state_rows


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

    @property
    def max_region_bytes(self) -> int:
        """The largest region ``alloc`` can ever give."""
        return self.nbytes


@dataclass
class StagingMemory:
    """``tensor``: the registered staging buffer (uint8, on the pools'
    device); ``area``: its allocator; ``fenced``: a fenced decode rank's
    (the write fence: peers write only here, into arenas; ``area`` is then
    a :class:`~transfer.staging.arenas.StagingArenas` over the span);
    ``buffers``: (role, layer, component) -> pool tensor; ``word_views``:
    the copies' cache of views of them. Built by
    :func:`transfer.staging.build.build_staging`."""

    tensor: torch.Tensor
    area: StagingArea  # or a StagingArenas (same alloc / free / free_bytes / nbytes / max_region_bytes)
    buffers: dict
    fenced: bool = False
    word_views: dict = field(default_factory=dict)

    @property
    def descriptor(self) -> StagingDescriptor:
        """What peers learn of it (fenced: its arenas' size too)."""
        return StagingDescriptor(addr=self.tensor.data_ptr(), nbytes=self.tensor.numel(),
                                 arena_bytes=self.area.max_region_bytes if self.fenced else 0)

    def gather_pages(self, offset: int, src_pages: np.ndarray, pools, layers_of) -> None:
        """Pack ``src_pages`` of ``pools`` (each with its page slice) at
        ``offset``, pool by pool; ``layers_of(pool)``: its layers packed
        (None: all). What a staged part of pages is gathered with."""
        pages = page_tensor(src_pages, self.tensor.device)
        for pool, sl in pools:
            offset += gather(self.tensor, offset, self.buffers, pool, sl, pages, self.word_views, layers_of(pool))

    def gather_items(self, offset: int, pool, items: np.ndarray, blocks) -> None:
        """Pack ``items`` of state pool ``pool`` (a
        :class:`~transfer.state_pools.StatePool`; ``blocks``: each buffer's
        row blocks) at ``offset``, buffer by buffer."""
        gather_state(self.tensor, offset, state_rows(pool), page_tensor(items, self.tensor.device), blocks)

    def touch(self) -> None:
        """Fault in the memory in use (benchmarks: as a warmed-up server has
        it); of a fenced span only the live arenas, never the whole span."""
        if self.fenced:
            self.area.touch()
        else:
            self.tensor.fill_(0)
