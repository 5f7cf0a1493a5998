"""What the storage benchmarks do before a timed write into the page cache."""

from __future__ import annotations

import numpy as np


def recycle_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory and free it, just before a timed
    write into the page cache: on this VM the first touch of memory the
    hypervisor took back costs far more than the write (0.3-0.5 GB/s), and
    a long-running server's page cache reuses its own pages."""
    scratch = np.empty(nbytes, dtype=np.uint8)
    scratch[::4096] = 1
    del scratch
