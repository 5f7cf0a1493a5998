"""The bare Mooncake engine and the pre-faulted buffers the raw baselines use
(:mod:`benchmarks.raw`, :mod:`benchmarks.raw_pages`).

This module uses the Mooncake engine directly on purpose: it is the
baseline that kvferry is measured against. Like kvferry
(:meth:`transfer.config.EngineConfig.mooncake_env`) it raises the TCP
transport's per-peer queue caps and bounds its timeouts through ``MC_*``
variables, filling in only those not already in the environment.
"""

from __future__ import annotations

import os

import numpy as np

from transfer.staging.hostmem import host_array


def make_engine(hostname: str, protocol: str, device: str = ""):
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    for key in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
        os.environ.setdefault(key, "65535")
    os.environ.setdefault("MC_TCP_ADMISSION_TIMEOUT_MS", "60000")
    # Bound every wait on a stalled peer (the status calls have no timeout of their own).
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", "30")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "30")
    from mooncake.engine import TransferEngine
    engine = TransferEngine()
    if engine.initialize(hostname, "P2PHANDSHAKE", protocol, device) != 0:
        raise SystemExit("mooncake initialize failed")
    return engine


def register_buffer(engine, buf: np.ndarray) -> None:
    """RDMA needs the local source registered too (TCP does not; it costs nothing there)."""
    if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise SystemExit("register_memory failed")


def register_region(engine, addr: int, nbytes: int) -> None:
    if engine.register_memory(addr, nbytes) != 0:
        raise SystemExit("register_memory failed")


def pool_buffer(nbytes: int, device: str = "cpu"):
    """(buffer, address) of ``nbytes`` on ``device``: pre-faulted host memory
    (``cpu``), or a CUDA tensor (what kvferry's CUDA pools are)."""
    if device == "cpu":
        buf = prefaulted_buffer(nbytes)
        return buf, buf.ctypes.data
    import torch
    buf = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(buf.device)
    return buf, buf.data_ptr()


def prefaulted_buffer(nbytes: int) -> np.ndarray:
    """Touched huge-page memory: the same kind kvferry's ranks use here (see transfer.staging.hostmem)."""
    return host_array(nbytes, fill=0x5A)
