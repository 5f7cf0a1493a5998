"""KV pools as the scheduler hands them over: tensors in, descriptors out.

Tensors may be CPU or CUDA; only ``data_ptr()``, shape, dtype and strides are
read, and no KV byte is copied. Shapes:

- MHA: per layer a K and a V tensor ``[num_pages, page_size, num_kv_heads, head_dim]``
  (``layout="nhd"``, the default) or ``[num_pages, num_kv_heads, page_size, head_dim]``
  (``layout="hnd"``, head-major pages: cheaper heterogeneous TP);
- MLA: per layer one latent tensor ``[num_pages, page_size, latent_dim]``
  (``kv_lora_rank + rope_dim``), or ``[num_pages, page_size, 1, latent_dim]``;
- fused K/V (vLLM): per layer one tensor, vLLM's view ``[num_pages,
  num_kv_heads, page_size, 2 * head_dim]`` of any layout it names LBHNC,
  LBNHC, BLHNC or BLNHC (see :mod:`transfer.fused_pool`);
- aux: ``[num_slots, ...]``, one row per request slot; a rank may have several
  aux regions sharing one row index (:func:`aux_tensors`).

Pools whose memory an engine owns and hands over as raw pointers (SGLang's
``KVArgs``) are described by :class:`RawPool`; :func:`pool_from_pointers`
views them as tensors without copying.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import numpy as np

from bootstrap.messages import (AttentionKind, AuxDescriptor, BufferRef, Component, PageLayout, PoolDescriptor,
                                PoolRole)
# Raw-pointer memory lives in transfer.raw_pools; re-exported here (public import path).
from transfer.raw_pools import RawAuxRegion, RawPool, _CudaMemory, head_dim_of, wrap_pointer  # noqa: F401
# vLLM's fused K/V pools live in transfer.fused_pool; re-exported here (public import path).
from transfer.fused_pool import FusedKVPool, describe_fused, fused_tensors


@dataclass(frozen=True)
class MHAPool:
    """``total_kv_heads`` is the model's KV head count (defaults to this rank's,
    right for TP 1; give it whenever TP > 1)."""

    k: Sequence[Any]
    v: Sequence[Any]
    role: PoolRole = PoolRole.TARGET
    total_kv_heads: int | None = None
    layout: str = "nhd"


@dataclass(frozen=True)
class MLAPool:
    latent: Sequence[Any]
    role: PoolRole = PoolRole.TARGET


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _check_tensor(t, shape, dtype: str, what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what}: shape {tuple(t.shape)} differs from {tuple(shape)}")
    if _dtype_name(t) != dtype:
        raise ValueError(f"{what}: dtype {_dtype_name(t)} differs from {dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: must be contiguous")


def describe_pool(pool: MHAPool | MLAPool | FusedKVPool) -> PoolDescriptor:
    """The wire descriptor of a pool; raises ValueError on inconsistent tensors."""
    if isinstance(pool, FusedKVPool):
        return describe_fused(pool)
    if isinstance(pool, MHAPool):
        if len(pool.k) != len(pool.v) or not pool.k:
            raise ValueError(f"{pool.role.value} pool: need as many K as V tensors, at least one")
        first = pool.k[0]
        if first.dim() != 4:
            raise ValueError(f"{pool.role.value} pool: MHA tensors are [num_pages, page_size, heads, head_dim]")
        page_layout = PageLayout(pool.layout)
        if page_layout is PageLayout.NHD:
            num_pages, page_size, heads, head_dim = first.shape
        else:
            num_pages, heads, page_size, head_dim = first.shape
        parts = [(Component.K, pool.k), (Component.V, pool.v)]
        attention, total = AttentionKind.MHA, pool.total_kv_heads or heads
    else:
        if not pool.latent:
            raise ValueError(f"{pool.role.value} pool: no latent tensors")
        first = pool.latent[0]
        if first.dim() == 4 and first.shape[2] == 1:
            num_pages, page_size, _, head_dim = first.shape
        elif first.dim() == 3:
            num_pages, page_size, head_dim = first.shape
        else:
            raise ValueError(f"{pool.role.value} pool: MLA tensors are [num_pages, page_size, latent_dim]")
        heads, total, page_layout = 1, 1, PageLayout.NHD
        parts = [(Component.LATENT, pool.latent)]
        attention = AttentionKind.MLA
    dtype = _dtype_name(first)
    buffers = []
    for comp, tensors in parts:
        for layer, t in enumerate(tensors):
            _check_tensor(t, first.shape, dtype, f"{pool.role.value} pool layer {layer} {comp.value}")
            buffers.append(BufferRef(layer=layer, component=comp, addr=t.data_ptr(),
                                     nbytes=t.numel() * t.element_size()))
    return PoolDescriptor(
        role=pool.role, attention=attention, dtype=dtype, itemsize=first.element_size(),
        page_size=int(page_size), num_pages=int(num_pages), num_layers=len(parts[0][1]),
        num_kv_heads=int(heads), total_kv_heads=int(total), head_dim=int(head_dim), page_layout=page_layout,
        buffers=tuple(buffers),
    )


def describe_aux(aux) -> AuxDescriptor:
    """The wire descriptor of an aux tensor ``[num_slots, ...]``."""
    if aux.dim() < 1 or not aux.is_contiguous():
        raise ValueError("aux: must be a contiguous tensor of one row per slot")
    num_slots = int(aux.shape[0])
    return AuxDescriptor(addr=aux.data_ptr(), slot_bytes=aux.numel() * aux.element_size() // num_slots,
                         num_slots=num_slots)


def aux_tensors(aux) -> tuple:
    """The aux regions as tensors ``[num_slots, ...]``, in order: ``aux`` is
    None (no region), one tensor, or a sequence of tensors and
    :class:`RawAuxRegion` (viewed as ``uint8 [num_rows, row_bytes]``, no
    copy). Raises ValueError on anything else."""
    if aux is None:
        return ()
    if hasattr(aux, "data_ptr") or isinstance(aux, RawAuxRegion):
        aux = (aux,)
    out = []
    for i, region in enumerate(aux):
        if isinstance(region, RawAuxRegion):
            region = wrap_pointer(region.addr, region.row_bytes * region.num_rows, "uint8",
                                  region.device).view(region.num_rows, region.row_bytes)
        elif not hasattr(region, "data_ptr"):
            raise ValueError(f"aux region {i}: a tensor or a RawAuxRegion, not {type(region).__name__}")
        out.append(region)
    return tuple(out)


def pool_tensors(pools: Sequence[MHAPool | MLAPool | FusedKVPool]) -> dict[tuple[PoolRole, int, Component], Any]:
    """(role, layer, component) -> tensor (a fused K/V layer: its blocks in physical order)."""
    out = {}
    for pool in pools:
        if isinstance(pool, FusedKVPool):
            out.update(fused_tensors(pool))
            continue
        parts = [(Component.K, pool.k), (Component.V, pool.v)] if isinstance(pool, MHAPool) \
            else [(Component.LATENT, pool.latent)]
        for comp, tensors in parts:
            for layer, t in enumerate(tensors):
                out[(pool.role, layer, comp)] = t
    return out


def memory_regions(pools: Sequence[PoolDescriptor], aux: Sequence[AuxDescriptor] = ()) -> list[tuple[int, int]]:
    """(addr, nbytes) of every buffer to register with the engine."""
    if isinstance(aux, AuxDescriptor):
        aux = (aux,)
    regions = [(b.addr, b.nbytes) for p in pools for b in p.buffers]
    regions.extend((a.addr, a.slot_bytes * a.num_slots) for a in aux or ())
    return regions


def registration_regions(pools: Sequence[MHAPool | MLAPool], aux=()) -> list[tuple[int, int]]:
    """(addr, nbytes) to register with the engine: one region per tensor, but
    tensors that are views of one allocation (vLLM-style K and V halves of
    one tensor, layers sliced from one block) register that allocation once,
    by its ``untyped_storage()`` (a CUDA engine registers a device pointer as
    its whole allocation; registering it per view repeats that). Tensors
    without ``untyped_storage`` count as their own allocation."""
    tensors = list(pool_tensors(pools).values()) + list(aux_tensors(aux))  # aux: None, a tensor or regions
    groups: dict[tuple[int, int], list] = {}
    for t in tensors:
        storage = getattr(t, "untyped_storage", None)
        key = (storage().data_ptr(), storage().nbytes()) if storage is not None else \
            (t.data_ptr(), t.numel() * t.element_size())
        groups.setdefault(key, []).append(t)
    regions = []
    for (base, nbytes), members in groups.items():
        if len(members) == 1:
            t = members[0]
            regions.append((t.data_ptr(), t.numel() * t.element_size()))
        else:
            regions.append((base, nbytes))
    return regions


def unique_regions(regions: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``regions`` without those inside another (a state buffer that views
    a KV pool's memory, as vLLM's KV-cache groups share their tensors): the
    engine registers each byte once. Order kept otherwise."""
    spans = sorted(set(regions), key=lambda r: (r[0], -r[1]))
    kept, end = set(), -1
    for addr, nbytes in spans:
        if addr + nbytes > end:
            kept.add((addr, nbytes))
            end = addr + nbytes
    out, seen = [], set()
    for r in regions:
        if r in kept and r not in seen:
            seen.add(r)
            out.append(r)
    return out


def pools_device(pools: Sequence[MHAPool | MLAPool]) -> str:
    """The device type every pool tensor lies on (``cpu``, ``cuda``); raises
    ValueError when they differ (the staging buffer needs one). The aux
    tensor may lie elsewhere (on the CPU beside CUDA pools)."""
    types = {str(t.device.type) for t in pool_tensors(pools).values()}
    if len(types) != 1:
        raise ValueError(f"pool tensors lie on several device types: {sorted(types)}")
    return types.pop()


def host_page_ids(values) -> np.ndarray:
    """Page ids (or tokens) as a flat int64 host array: a list, a numpy array,
    or a tensor on any device (a CUDA tensor is copied to the host once,
    which waits for the stream that produced it)."""
    device = getattr(values, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        values = values.cpu()
    if hasattr(values, "numpy") and not isinstance(values, np.ndarray):
        values = values.numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


def pool_from_pointers(raw: RawPool) -> MHAPool | MLAPool:
    """An :class:`MHAPool` / :class:`MLAPool` whose tensors view the raw buffers."""
    import torch

    itemsize = torch.empty(0, dtype=getattr(torch, raw.dtype)).element_size() \
        if isinstance(getattr(torch, raw.dtype, None), torch.dtype) else 0
    if not itemsize:
        raise ValueError(f"{raw.role.value} raw pool: unknown dtype {raw.dtype!r}")
    heads = raw.num_kv_heads if raw.attention == "mha" else 1
    head_dim = head_dim_of(raw.page_bytes[0], raw.page_size, heads, itemsize)
    num_pages = raw.num_pages
    if raw.attention == "mha" and raw.layout == "hnd":
        shape = (num_pages, heads, raw.page_size, head_dim)
    elif raw.attention == "mha":
        shape = (num_pages, raw.page_size, heads, head_dim)
    else:
        shape = (num_pages, raw.page_size, head_dim)
    used = num_pages * raw.page_bytes[0]
    tensors = [wrap_pointer(a, used, raw.dtype, raw.device).view(shape) for a in raw.addrs]
    if raw.attention == "mla":
        return MLAPool(latent=tensors, role=raw.role)
    half = len(tensors) // 2
    return MHAPool(k=tensors[:half], v=tensors[half:], role=raw.role, total_kv_heads=raw.total_kv_heads,
                   layout=raw.layout)
