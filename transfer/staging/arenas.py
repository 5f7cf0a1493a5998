"""Decode's fenced staging memory: a set of arenas, each registered with the
transport on its own, carved from one virtual span that peers know.

The rule it keeps (the write fence, see docs/reliability.md): a region that
a lost peer may still write into is never read again and never granted
again. A lost peer is one whose room failed without its confirmation that
no write is in flight (silent, hung, stopped). Its regions are *poisoned*:
their arena is *retired* (no new grants in it); once the arena's other
grants ended it is unregistered from the transport, its physical pages are
released, and a fresh arena at a new address of the span replaces it. The
retired range stays mapped and is never handed out again, so a descriptor
the engine accepted before the unregistration (Mooncake's TCP transport
validates an address once per write request, not per byte) lands in memory
nobody reads.

Host memory: the span is one anonymous mapping of ``num_slots`` arenas,
reserved without backing (``MAP_NORESERVE``, pages untouched until used);
releasing an arena is ``madvise(MADV_DONTNEED)``. Once every slot was used
the set shrinks by one arena per retirement (a warning says so); with the
default 1024 slots that takes a thousand lost peers in one process.

CUDA memory (one device allocation of ``num_arenas`` arenas): retiring an
arena deregisters it, which invalidates its RDMA keys, so a late RDMA write
is refused by the NIC; the allocation is kept alive and, once its other
grants ended, the same range is registered again (new keys) and reused.
Over TCP, where validation is by address only, device staging is *not*
fenced.

Thread-safety: every method is called under the owner's lock (the room
context's); ``register`` and ``unregister`` of the transport return quickly.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass, field
from collections.abc import Callable

import numpy as np
import torch

from transfer.staging.area import StagingArea

log = logging.getLogger("kvferry.staging")

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value where Python does not name it
#: Virtual arena slots of a host span (a retired arena's slot is never reused).
NUM_SLOTS = 1024


@dataclass
class Arena:
    """One registered arena: ``slot`` of the span, its allocator, and how
    many of its regions are granted (``num_granted``; poisoned ones excluded)."""

    slot: int
    area: StagingArea
    num_granted: int = 0
    retired: bool = False
    poisoned: list[tuple[int, int]] = field(default_factory=list)  # (span offset, nbytes)


class StagingArenas:
    """Allocator of decode's fenced staging: ``alloc`` and ``free`` work on
    offsets into the span (what grants name); ``poison`` retires the arena
    of a region a lost peer may still write."""

    def __init__(self, tensor: torch.Tensor, arena_bytes: int, num_arenas: int,
                 register: Callable[[list[tuple[int, int]]], None],
                 unregister: Callable[[list[tuple[int, int]]], None]) -> None:
        """``tensor``: the span (uint8); its first ``num_arenas`` slots are
        registered now with ``register([(addr, nbytes)])``."""
        self.tensor = tensor
        self.arena_bytes = arena_bytes
        self.num_slots = tensor.numel() // arena_bytes
        self.on_host = tensor.device.type == "cpu"
        self._register, self._unregister = register, unregister
        self.arenas: list[Arena] = []
        self._next_slot = 0
        #: arenas retired and replaced so far
        self.num_retired = 0
        for _ in range(num_arenas):
            self._open()

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        """Bytes of the live (not retired) arenas."""
        return sum(self.arena_bytes for a in self.arenas if not a.retired)

    @property
    def free_bytes(self) -> int:
        return sum(a.area.free_bytes for a in self.arenas if not a.retired)

    @property
    def max_region_bytes(self) -> int:
        """The largest region ``alloc`` can give: one arena."""
        return self.arena_bytes

    def touch(self) -> None:
        """Fault in the live arenas (what a warmed-up server has); never the whole span."""
        for a in self.arenas:
            self.tensor[a.slot * self.arena_bytes:(a.slot + 1) * self.arena_bytes].fill_(0)

    def _region(self, slot: int) -> tuple[int, int]:
        return self.addr + slot * self.arena_bytes, self.arena_bytes

    def _open(self, slot: int | None = None) -> None:
        if slot is None:
            if self._next_slot >= self.num_slots:
                log.warning("staging: every one of the %d arena slots was used; %d arenas remain",
                            self.num_slots, len(self.arenas))
                return
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        self._register([self._region(slot)])
        self.arenas.append(Arena(slot, StagingArea(self.arena_bytes)))

    def _find(self, offset: int) -> Arena | None:
        slot = offset // self.arena_bytes
        return next((a for a in self.arenas if a.slot == slot), None)

    def alloc(self, nbytes: int) -> int | None:
        """A region of ``nbytes`` inside one live arena (its span offset), or None."""
        if nbytes > self.arena_bytes:
            return None
        for arena in self.arenas:
            if not arena.retired and (off := arena.area.alloc(nbytes)) is not None:
                arena.num_granted += 1
                return arena.slot * self.arena_bytes + off
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """A granted region is no longer written nor read."""
        arena = self._find(offset)
        if arena is None:
            return
        arena.area.free(offset - arena.slot * self.arena_bytes, nbytes)
        arena.num_granted -= 1
        if arena.retired and arena.num_granted == 0:
            self._replace(arena)

    def poison(self, offset: int, nbytes: int) -> None:
        """A lost peer may still write ``[offset, +nbytes)``: never read nor
        grant it again; retire its arena (replaced once its other grants end)."""
        arena = self._find(offset)
        if arena is None:
            return
        arena.num_granted -= 1
        arena.poisoned.append((offset, nbytes))
        if not arena.retired:
            arena.retired = True
            log.warning("staging: arena at %#x retired: a lost peer may still write into it",
                        self._region(arena.slot)[0])
        if arena.num_granted == 0:
            self._replace(arena)

    def _replace(self, arena: Arena) -> None:
        region = self._region(arena.slot)
        self._unregister([region])
        self.arenas.remove(arena)
        self.num_retired += 1
        if self.on_host:
            _release(self.tensor, arena.slot * self.arena_bytes, self.arena_bytes)
            self._open()
        else:  # device memory: same range, new registration (new RDMA keys)
            self._open(arena.slot)


def _release(tensor: torch.Tensor, offset: int, nbytes: int) -> None:
    """Give the physical pages of a host range back (the mapping stays)."""
    mapping = getattr(tensor, "_kvferry_mapping", None)
    if mapping is None:
        return
    try:
        mapping.madvise(mmap.MADV_DONTNEED, offset, nbytes)
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("staging: releasing %d bytes of a retired arena failed: %s", nbytes, exc)


def span_tensor(arena_bytes: int, num_arenas: int, device: torch.device) -> torch.Tensor:
    """The span of a fenced staging: on host ``NUM_SLOTS`` arenas of virtual
    memory, unbacked until used; on a device ``num_arenas`` arenas."""
    if device.type != "cpu":
        return torch.zeros(arena_bytes * num_arenas, dtype=torch.uint8, device=device)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    for slots in (max(NUM_SLOTS, num_arenas), 16 * num_arenas, num_arenas):
        try:  # strict overcommit accounting may refuse a large reservation
            mapping = mmap.mmap(-1, arena_bytes * slots, flags=flags)
            break
        except OSError:
            if slots == num_arenas:
                raise
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:
            pass
    tensor = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
    tensor._kvferry_mapping = mapping  # the mapping lives as long as the tensor
    return tensor


def arena_layout(staging_bytes: int, part_bytes: int) -> tuple[int, int]:
    """(arena_bytes, num_arenas): up to 4 arenas of at least a part each,
    together ``staging_bytes`` (4 KiB aligned)."""
    num = max(1, min(4, staging_bytes // max(1, part_bytes)))
    arena = staging_bytes // num // StagingArea.ALIGN * StagingArea.ALIGN
    return max(arena, StagingArea.ALIGN), num
