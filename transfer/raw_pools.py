"""Raw-pointer memory: pools and aux regions an engine owns and hands over as
integer pointers (SGLang's ``KVArgs``), and :func:`wrap_pointer`, which views such
memory as a tensor without copying. :func:`transfer.pools.pool_from_pointers`
builds tensor pools from a :class:`RawPool`."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

from bootstrap.messages import PoolRole


@dataclass(frozen=True, kw_only=True)
class RawAuxRegion:
    """One aux region as raw memory: ``num_rows`` rows of ``row_bytes`` at
    ``addr`` (one row per request slot). The memory stays the engine's and
    must outlive the KVManager."""

    addr: int
    row_bytes: int
    num_rows: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not 0 < self.addr < 1 << 64:
            raise ValueError("raw aux region: addr must be a non-null 64-bit pointer")
        if self.row_bytes <= 0 or self.num_rows <= 0:
            raise ValueError(f"raw aux region: row_bytes and num_rows must be > 0, got {self.row_bytes}, "
                             f"{self.num_rows}")


# --- pools described by raw pointers ------------------------------------------------
# Engines that own their KV memory (SGLang's KVArgs) hand over integer pointers,
# buffer lengths and per-page item sizes, not tensors. ``pool_from_pointers``
# wraps each buffer as a tensor view of that memory (no byte is copied), so the
# descriptors, registration and the staged path's gather/scatter work on it
# unchanged. The memory stays the engine's: it must outlive the KVManager.


@dataclass(frozen=True, kw_only=True)
class RawPool:
    """One pool as raw buffers.

    ``addrs``/``nbytes``/``page_bytes``: one entry per buffer, MHA as
    ``[K_0..K_{L-1}, V_0..V_{L-1}]``, MLA one latent buffer per layer.
    ``page_bytes`` is a buffer's bytes per page (SGLang's ``item_len``); the
    head dim is derived from it: ``page_bytes / (page_size * num_kv_heads *
    itemsize)`` (MLA: ``num_kv_heads`` 1, the latent width). ``dtype`` is a
    torch dtype name (``bfloat16``, ``float8_e4m3fn``, ``uint8``...).
    ``device`` is ``cpu`` or ``cuda[:N]``.
    """

    attention: str  # "mha" or "mla"
    addrs: Sequence[int]
    nbytes: Sequence[int]
    page_bytes: Sequence[int]
    page_size: int
    dtype: str
    num_kv_heads: int = 1
    total_kv_heads: int | None = None
    role: PoolRole = PoolRole.TARGET
    device: str = "cpu"
    layout: str = "nhd"

    def __post_init__(self) -> None:
        what = f"{self.role.value} raw pool"
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"{what}: attention must be 'mha' or 'mla', got {self.attention!r}")
        n = len(self.addrs)
        if not n or len(self.nbytes) != n or len(self.page_bytes) != n:
            raise ValueError(f"{what}: addrs, nbytes and page_bytes must be non-empty and of one length "
                             f"({len(self.addrs)}, {len(self.nbytes)}, {len(self.page_bytes)})")
        if self.attention == "mha" and n % 2:
            raise ValueError(f"{what}: an MHA pool has as many K as V buffers, got {n} buffers")
        if len(set(self.page_bytes)) != 1 or len(set(self.nbytes)) != 1:
            raise ValueError(f"{what}: every buffer must have the same page_bytes and nbytes "
                             f"(got {sorted(set(self.page_bytes))} and {sorted(set(self.nbytes))})")
        if self.page_size <= 0 or self.num_kv_heads <= 0 or self.page_bytes[0] <= 0:
            raise ValueError(f"{what}: page_size, num_kv_heads and page_bytes must be > 0")
        if self.nbytes[0] < self.page_bytes[0]:
            raise ValueError(f"{what}: a buffer of {self.nbytes[0]} bytes holds no page of {self.page_bytes[0]}")
        if any(not 0 < a < 1 << 64 for a in self.addrs):
            raise ValueError(f"{what}: every address must be a non-null 64-bit pointer")

    @property
    def num_pages(self) -> int:
        return self.nbytes[0] // self.page_bytes[0]


def head_dim_of(page_bytes: int, page_size: int, num_kv_heads: int, itemsize: int) -> int:
    """The head dim a page of ``page_bytes`` implies; ValueError unless exact."""
    per_head = page_size * num_kv_heads * itemsize
    if page_bytes % per_head:
        raise ValueError(f"a page of {page_bytes} bytes is not {page_size} tokens x {num_kv_heads} heads x "
                         f"{itemsize}-byte elements")
    return page_bytes // per_head


class _CudaMemory:
    """Device memory as ``__cuda_array_interface__`` bytes, so torch can view it without a copy."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 3, "strides": None}


def wrap_pointer(addr: int, nbytes: int, dtype: str, device: str = "cpu"):
    """A 1-D tensor of ``dtype`` viewing ``nbytes`` at ``addr`` (no copy).
    CPU memory through ctypes, CUDA memory through ``__cuda_array_interface__``.
    The memory must outlive the tensor."""
    import ctypes

    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    if device == "cpu":
        raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8, count=nbytes)
    elif device.startswith("cuda"):
        with torch.cuda.device(torch.device(device)):
            raw = torch.as_tensor(_CudaMemory(addr, nbytes), device=device)
    else:
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")
    return raw.view(torch_dtype)
