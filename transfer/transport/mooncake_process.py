"""What the Mooncake engine does to its process, and how kvferry keeps it in
check: its start-up lines on standard error, its slow destructor, and
whether RDMA is really there (see :mod:`transfer.transport.mooncake`)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys


def rdma_devices(root: str = "/sys/class/infiniband") -> list[str]:
    """The RDMA devices of this host (empty without any)."""
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


def keep_forever(obj) -> None:
    """Take a reference that is never given back: ``obj`` is never destroyed."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


@contextlib.contextmanager
def stderr_discarded(discard: bool):
    """Discard what is written to file descriptor 2 (the engine's C++ logs)
    inside the block, when ``discard``; the whole process's standard error
    is affected for that time (about a millisecond)."""
    if not discard:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
