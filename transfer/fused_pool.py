"""vLLM's KV caches as a kvferry pool: K and V fused in one buffer per layer.

vLLM (0.32) hands a connector one tensor per layer, the logical view
``[num_blocks, kv_heads, block_size, 2 * head_size]`` of a physical layout
named by ``vllm.v1.kv_cache_layout.KVCacheLayout`` (logical axes ``[L, B,
H, N, C]``, ``C`` a head's K then V). Only ``data_ptr()``, shape, dtype and
strides are read; the physical order comes from the strides:

==========  ==========================  ======================  ====================
vLLM name   physical order              kvferry page interior   page stride
==========  ==========================  ======================  ====================
``LBHNC``   per layer ``[B, H, N, C]``  HND (head-major)        the page's bytes
``LBNHC``   per layer ``[B, N, H, C]``  NHD (token-major)       the page's bytes
``BLHNC``   ``[B, L, H, N, C]``         HND                     ``L`` x the page's
``BLNHC``   ``[B, L, N, H, C]``         NHD                     ``L`` x the page's
==========  ==========================  ======================  ====================

``LHBNC`` and ``BHLNC`` keep a head of all blocks together (a page is not one
run per head): refused. What ``C`` holds is the backend's: vLLM's CPU backend
(``LBHNC`` only) keeps a (block, head)'s ``N`` K rows, then its ``N`` V rows
(``kv_layout="fused_rows"``, the default); the GPU backends keep each
(token, head) cell's K then V (``"fused_cells"``). Both sides of a transfer
must agree on that and on the interior; the handshake names both layouts
where they differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

from bootstrap.messages import AttentionKind, BufferRef, Component, KVLayout, PageLayout, PoolDescriptor, PoolRole

#: vLLM's KVCacheLayout names kvferry describes, and their page interior.
VLLM_LAYOUTS = {"LBHNC": PageLayout.HND, "LBNHC": PageLayout.NHD, "BLHNC": PageLayout.HND,
                "BLNHC": PageLayout.NHD}


@dataclass(frozen=True)
class FusedKVPool:
    """One tensor per layer holding K and V: vLLM's per-layer view
    ``[num_blocks, kv_heads, block_size, 2 * head_size]`` in any of
    :data:`VLLM_LAYOUTS` (the layers may be views of one buffer).
    ``total_kv_heads``: the model's KV heads (give it whenever TP > 1; this
    rank holds its slice, as vLLM shards them). ``vllm_layout``: vLLM's
    resolved layout name, checked against the strides when given.

    On the wire an MHA pool of one ``kv`` buffer per layer, sliced by heads
    across TP ranks like any MHA pool."""

    kv: Sequence[Any]
    role: PoolRole = PoolRole.TARGET
    total_kv_heads: int | None = None
    kv_layout: str = "fused_rows"
    vllm_layout: str | None = None


@dataclass(frozen=True)
class _Geometry:
    interior: PageLayout
    page_bytes: int
    page_stride_bytes: int


def _what(pool: FusedKVPool, layer: int | None = None) -> str:
    return f"{pool.role.value} fused K/V pool" + ("" if layer is None else f" layer {layer}")


def _geometry(pool: FusedKVPool, layer: int, t) -> _Geometry:
    if t.dim() != 4 or t.shape[3] % 2:
        raise ValueError(f"{_what(pool, layer)}: tensors are [num_blocks, kv_heads, block_size, 2 * head_dim], "
                         f"got {tuple(t.shape)}")
    _, heads, size, width = t.shape
    s = t.stride()
    if s[3] != 1:
        raise ValueError(f"{_what(pool, layer)}: a head's K and V must be contiguous (strides {s})")
    if (s[2] == width or size == 1) and (s[1] == size * width or heads == 1):
        interior = PageLayout.HND
    elif (s[1] == width or heads == 1) and s[2] == heads * width:
        interior = PageLayout.NHD
    else:
        raise ValueError(f"{_what(pool, layer)}: strides {s} are neither head-major (LBHNC/BLHNC) nor token-major "
                         "(LBNHC/BLNHC) blocks; vLLM's LHBNC and BHLNC (a head of all blocks together) are not "
                         "supported")
    page_bytes = heads * size * width * t.element_size()
    stride = s[0] * t.element_size()
    if stride < page_bytes:
        raise ValueError(f"{_what(pool, layer)}: block stride {stride} bytes below the block's {page_bytes}")
    return _Geometry(interior, page_bytes, stride)


def _checked(pool: FusedKVPool) -> tuple[list, _Geometry]:
    """The layers and their common geometry; ValueError on anything else."""
    if not pool.kv:
        raise ValueError(f"{_what(pool)}: no fused K/V tensors")
    try:
        kind = KVLayout(pool.kv_layout)
    except ValueError:
        raise ValueError(f"{_what(pool)}: kv_layout must be 'fused_rows' or 'fused_cells', "
                         f"got {pool.kv_layout!r}") from None
    first = pool.kv[0]
    geo = _geometry(pool, 0, first)
    for layer, t in enumerate(pool.kv):
        if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype or t.stride() != first.stride():
            raise ValueError(f"{_what(pool, layer)}: shape, dtype and strides must equal layer 0's")
    if kind is KVLayout.SPLIT or (kind is KVLayout.FUSED_ROWS and geo.interior is not PageLayout.HND):
        raise ValueError(f"{_what(pool)}: kv_layout {kind.value} (vLLM's CPU backend) needs contiguous "
                         "head-major (LBHNC) blocks" if
                         kind is KVLayout.FUSED_ROWS else f"{_what(pool)}: kv_layout split is not a fused pool")
    if pool.vllm_layout is not None:
        want = VLLM_LAYOUTS.get(pool.vllm_layout)
        if want is None:
            raise ValueError(f"{_what(pool)}: vLLM KV cache layout {pool.vllm_layout} is not supported "
                             f"(supported: {', '.join(VLLM_LAYOUTS)})")
        cross = geo.page_stride_bytes != geo.page_bytes
        if want is not geo.interior or (len(pool.kv) > 1 and pool.vllm_layout.startswith("BL") != cross):
            raise ValueError(f"{_what(pool)}: strides {first.stride()} do not match vLLM layout {pool.vllm_layout}")
    return list(pool.kv), geo


def page_view(pool: FusedKVPool, t):
    """A layer as ``[num_blocks, ...]`` in physical order: each block's
    bytes contiguous (pages ``page_stride`` apart); a view, never a copy."""
    return t if _geometry(pool, 0, t).interior is PageLayout.HND else t.permute(0, 2, 1, 3)


def describe_fused(pool: FusedKVPool) -> PoolDescriptor:
    """The wire descriptor: an MHA pool of one ``kv`` buffer per layer."""
    layers, geo = _checked(pool)
    first = layers[0]
    num_pages, heads, size, width = (int(x) for x in first.shape)
    buffers = tuple(BufferRef(layer=i, component=Component.KV, addr=t.data_ptr(),
                              nbytes=(num_pages - 1) * geo.page_stride_bytes + geo.page_bytes)
                    for i, t in enumerate(layers))
    return PoolDescriptor(
        role=pool.role, attention=AttentionKind.MHA, dtype=str(first.dtype).removeprefix("torch."),
        itemsize=first.element_size(), page_size=size, num_pages=num_pages, num_layers=len(layers),
        num_kv_heads=heads, total_kv_heads=int(pool.total_kv_heads or heads), head_dim=width // 2,
        page_layout=geo.interior, buffers=buffers, kv_layout=KVLayout(pool.kv_layout),
        page_stride_bytes=0 if geo.page_stride_bytes == geo.page_bytes else geo.page_stride_bytes)


def fused_tensors(pool: FusedKVPool) -> dict:
    """(role, layer, ``kv``) -> the layer's :func:`page_view`."""
    layers, _ = _checked(pool)
    return {(pool.role, i, Component.KV): page_view(pool, t) for i, t in enumerate(layers)}
