"""A pool's pages as storage segments, and a pool's key fingerprint.

A page of a pool lies in every per-layer tensor: page ``p`` of a tensor
``[num_pages, ...]`` is the block at ``data_ptr() + p * page_bytes``. Its
storage value is those blocks in a fixed order, **per layer, then per
component** (MHA: layer 0 K, layer 0 V, layer 1 K, ...; MLA: one latent block
per layer), so two pools with equal fingerprints lay a page out the same way.

Only the public :class:`~transfer.pools.MHAPool` / :class:`~transfer.pools.MLAPool`
fields are read (``data_ptr()``, shape, dtype, strides); no byte is copied.
Tensors must be contiguous, with the page as the leading dimension.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

from bootstrap.descriptors import AttentionKind
from transfer.pools import FusedKVPool, MHAPool, MLAPool, describe_pool, fused_tensors
from transfer.storage.base import Segment
from transfer.storage.keys import PoolFingerprint


def _layer_tensors(pool: MHAPool | MLAPool) -> list[list[Any]]:
    """Per layer, the pool's tensors in component order."""
    if isinstance(pool, MHAPool):
        if len(pool.k) != len(pool.v) or not pool.k:
            raise ValueError(f"{_role(pool)} pool: need as many K as V tensors, at least one")
        return [[k, v] for k, v in zip(pool.k, pool.v, strict=True)]
    if isinstance(pool, MLAPool):
        if not pool.latent:
            raise ValueError(f"{_role(pool)} pool: no latent tensors")
        return [[t] for t in pool.latent]
    if isinstance(pool, FusedKVPool):  # each layer's blocks in physical order: [num_pages, ...]
        if describe_pool(pool).page_stride_bytes:
            raise ValueError(f"{_role(pool)} pool: the storage tier takes dense pages; vLLM's cross-layer "
                             "blocks (page stride above the page's bytes) are not supported")
        return [[t] for t in fused_tensors(pool).values()]
    raise TypeError(f"expected an MHAPool or MLAPool, got {type(pool).__name__}")


def _role(pool) -> str:
    return getattr(pool.role, "value", pool.role)


def _page_blocks(pool: MHAPool | MLAPool) -> tuple[list[int], int, int]:
    """(base address of every tensor in page order, page bytes, num pages)."""
    layers = _layer_tensors(pool)
    first = layers[0][0]
    num_pages, page_bytes = int(first.shape[0]), first.stride(0) * first.element_size()
    bases = []
    for layer, tensors in enumerate(layers):
        for t in tensors:
            if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
                raise ValueError(f"{_role(pool)} pool layer {layer}: shape {tuple(t.shape)} {t.dtype} differs from "
                                 f"{tuple(first.shape)} {first.dtype}")
            if not t.is_contiguous() and not isinstance(pool, FusedKVPool):  # fused: checked dense above
                raise ValueError(f"{_role(pool)} pool layer {layer}: tensors must be contiguous")
            bases.append(t.data_ptr())
    return bases, page_bytes, num_pages


def page_bytes(pool: MHAPool | MLAPool) -> int:
    """Bytes of one page's value (all layers and components)."""
    bases, nbytes, _ = _page_blocks(pool)
    return len(bases) * nbytes


def pages_segments(pool: MHAPool | MLAPool, pages: Sequence[int]) -> list[list[Segment]]:
    """The segments of each of ``pages`` (page indices of the pool), in the
    storage order; ValueError for a page out of range."""
    bases, nbytes, num_pages = _page_blocks(pool)
    out = []
    for page in pages:
        page = int(page)
        if not 0 <= page < num_pages:
            raise ValueError(f"{_role(pool)} pool: page {page} not in [0, {num_pages})")
        offset = page * nbytes
        out.append([(base + offset, nbytes) for base in bases])
    return out


def page_segments(pool: MHAPool | MLAPool, page: int) -> list[Segment]:
    """The segments of one page."""
    return pages_segments(pool, [page])[0]


def pool_regions(pool: MHAPool | MLAPool) -> list[Segment]:
    """Every tensor of the pool as one region, for ``StorageBackend.register_memory``."""
    bases, nbytes, num_pages = _page_blocks(pool)
    return [(base, nbytes * num_pages) for base in bases]


def pool_fingerprint(pool: MHAPool | MLAPool, *, model: str, tp_rank: int = 0, tp_size: int = 1,
                     extra: str = "") -> PoolFingerprint:
    """The key fingerprint of a pool on one TP rank. An MLA pool is the same
    on every rank, so its fingerprint ignores ``tp_rank``/``tp_size`` and its
    pages are shared across ranks; an MHA pool's names its head slice."""
    d = describe_pool(pool)  # checks the tensors and reads their shapes (the one parser: transfer.pools)
    mla = d.attention is AttentionKind.MLA
    if isinstance(pool, FusedKVPool):  # an MHA pool of one K+V buffer per layer; extra names the packing
        extra = f"{d.kv_layout.value}{'|' + extra if extra else ''}"
    return PoolFingerprint(model=model, role=_role(pool), attention=d.attention.value, page_layout=d.page_layout.value,
                           dtype=d.dtype, page_size=d.page_size, num_layers=d.num_layers, num_kv_heads=d.num_kv_heads,
                           head_dim=d.head_dim, tp_rank=0 if mla else tp_rank, tp_size=1 if mla else tp_size,
                           extra=extra)
