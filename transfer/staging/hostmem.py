"""Host memory for buffers the engine moves: anonymous mappings backed by
transparent huge pages where the kernel allows it, touched up front or left
to fault in as used.

On TCP the kernel copies every byte between user memory and socket buffers;
with 4 KiB pages those copies miss the TLB far more often than with 2 MiB
ones. On the development VM (``transparent_hugepage=madvise``) a transfer
from and into ordinary ``torch.empty`` memory ran at 85-90% of the speed of
the same transfer between huge-page buffers (which numpy hands out for large
arrays by itself). kvferry's own CPU staging buffer comes from here; the
benchmark and tests allocate their CPU pools here too, so that kvferry and
the raw Mooncake baselines move bytes between the same kind of memory.

Users whose KV pools live in host memory get the same effect with
``THP_MEM_ALLOC_ENABLE=1`` (torch's CPU allocator then asks for huge pages)
or by allocating them with :func:`host_tensor`.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20


def host_array(nbytes: int, fill: int | None = 0) -> np.ndarray:
    """A uint8 array of ``nbytes``: every page touched (set to ``fill``), or
    with ``fill=None`` left untouched (zero, its pages fault in at first
    use: on this VM touching fresh memory runs at about 0.3 GB/s, 0.8 s for
    256 MiB, which a buffer used only in part need not pay up front).

    Anonymous mmap, advised ``MADV_HUGEPAGE`` where the platform has it; the
    mapping lives as long as the array or any view of it."""
    if nbytes <= 0:
        return np.empty(0, dtype=np.uint8)
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)  # private: shared ones are shmem
    mapping = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and nbytes >= HUGE_PAGE:
        try:
            mapping.madvise(advice)
        except OSError:  # THP switched off in this kernel: ordinary pages
            pass
    array = np.frombuffer(mapping, dtype=np.uint8)[:nbytes]
    if fill is not None:
        array.fill(fill)  # pre-fault: the first touch is slow and erratic
    return array


def host_tensor(nbytes: int, fill: int | None = 0):
    """:func:`host_array` as a uint8 CPU torch tensor (sharing the memory)."""
    import torch  # here, so that numpy-only processes (raw baselines) need not load torch

    return torch.from_numpy(host_array(nbytes, fill))


def smaps_kib(addr: int, field: str) -> int | None:
    """A field (``Rss``, ``AnonHugePages``, ...) of the mapping of this
    process that holds ``addr``, in KiB; None where no mapping holds it or
    /proc does not say. For tests and diagnostics."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def is_huge_backed(tensor) -> bool | None:
    """Whether a CPU tensor's (or array's) mapping holds huge pages (None
    where /proc does not say)."""
    addr = tensor.ctypes.data if isinstance(tensor, np.ndarray) else tensor.data_ptr()
    kib = smaps_kib(addr, "AnonHugePages")
    return None if kib is None else kib > 0
