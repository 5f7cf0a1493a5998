"""Builders of descriptors with fake (non-null, non-overlapping) addresses,
shared by the unit tests. Pure: no tensors, no engine."""

from __future__ import annotations

from collections.abc import Sequence

from bootstrap.messages import (
    AttentionKind,
    AuxDescriptor,
    BufferRef,
    Component,
    PageLayout,
    PoolDescriptor,
    PoolRole,
    RankInfo,
    components_of,
)

DEFAULT_BASE = 0x7F00_0000_0000


def page_bytes(page_size: int, heads: int, head_dim: int, itemsize: int) -> int:
    return page_size * heads * head_dim * itemsize


def make_pool(
    *,
    role: PoolRole = PoolRole.TARGET,
    attention: AttentionKind = AttentionKind.MHA,
    dtype: str = "bfloat16",
    itemsize: int = 2,
    page_size: int = 16,
    num_pages: int = 64,
    num_layers: int = 2,
    num_kv_heads: int = 4,
    total_kv_heads: int | None = None,
    head_dim: int = 128,
    page_layout: PageLayout = PageLayout.NHD,
    base: int = DEFAULT_BASE,
    gaps: Sequence[int] | int = 4096,
    memory_order: Sequence[int] | None = None,
    tuple_order: Sequence[int] | None = None,
) -> PoolDescriptor:
    """A pool whose buffers lie one after the other from ``base``.

    Buffers are enumerated as (layer, component) in canonical order (layer
    major, K before V). ``memory_order`` is a permutation giving which
    canonical buffer comes 1st, 2nd, ... in memory; ``gaps`` is the number of
    unused bytes after each buffer (an int for all of them). ``tuple_order``
    permutes the ``buffers`` tuple itself (pairing must not rely on it).
    """
    if attention is AttentionKind.MLA:
        num_kv_heads = 1
        total_kv_heads = 1
    if total_kv_heads is None:
        total_kv_heads = num_kv_heads
    comps = components_of(attention)
    keys = [(layer, c) for layer in range(num_layers) for c in comps]
    n = len(keys)
    nbytes = num_pages * page_bytes(page_size, num_kv_heads, head_dim, itemsize)
    if isinstance(gaps, int):
        gaps = [gaps] * n
    memory_order = list(range(n)) if memory_order is None else list(memory_order)
    assert sorted(memory_order) == list(range(n))
    addrs: dict[int, int] = {}
    addr = base
    for slot, idx in enumerate(memory_order):
        addrs[idx] = addr
        addr += nbytes + gaps[slot]
    refs = [BufferRef(layer=layer, component=c, addr=addrs[i], nbytes=nbytes)
            for i, (layer, c) in enumerate(keys)]
    if tuple_order is not None:
        assert sorted(tuple_order) == list(range(n))
        refs = [refs[i] for i in tuple_order]
    return PoolDescriptor(
        role=role, attention=attention, dtype=dtype, itemsize=itemsize, page_size=page_size,
        num_pages=num_pages, num_layers=num_layers, num_kv_heads=num_kv_heads,
        total_kv_heads=total_kv_heads, head_dim=head_dim, page_layout=page_layout, buffers=tuple(refs),
    )


def make_aux(addr: int = 0x5500_0000_0000, slot_bytes: int = 64, num_slots: int = 128) -> AuxDescriptor:
    return AuxDescriptor(addr=addr, slot_bytes=slot_bytes, num_slots=num_slots)


def make_rank(
    *,
    node_id: str = "prefill-0",
    dp_rank: int = 0,
    dp_size: int = 1,
    tp_rank: int = 0,
    tp_size: int = 1,
    session: str | None = None,
    control_endpoint: str | None = None,
    pools: Sequence[PoolDescriptor] | None = None,
    aux: AuxDescriptor | None | str = "default",
) -> RankInfo:
    if pools is None:
        pools = (make_pool(),)
    if aux == "default":
        aux = make_aux()
    return RankInfo(
        node_id=node_id,
        dp_rank=dp_rank,
        dp_size=dp_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        session=session or f"10.0.0.{tp_rank + 1}:17{dp_rank}{tp_rank:02d}",
        control_endpoint=control_endpoint or f"tcp://10.0.0.{tp_rank + 1}:{5600 + tp_rank}",
        pools=tuple(pools),
        aux=aux,
    )


def mha_rank(*, tp_rank: int = 0, tp_size: int = 1, total_heads: int = 8, head_dim: int = 128,
             page_size: int = 16, num_layers: int = 2, draft: bool = False, **kw) -> RankInfo:
    """A rank holding an MHA target pool sliced for ``tp_size`` (and optionally a draft pool)."""
    per = total_heads // tp_size if total_heads >= tp_size else 1
    pools = [make_pool(num_kv_heads=per, total_kv_heads=total_heads, head_dim=head_dim,
                       page_size=page_size, num_layers=num_layers)]
    if draft:
        pools.append(make_pool(role=PoolRole.DRAFT, num_kv_heads=per, total_kv_heads=total_heads,
                               head_dim=head_dim, page_size=page_size, num_layers=1,
                               base=0x6600_0000_0000))
    return make_rank(tp_rank=tp_rank, tp_size=tp_size, pools=pools, **kw)


__all__ = ["AttentionKind", "Component", "PoolRole", "make_aux", "make_pool", "make_rank", "mha_rank",
           "page_bytes"]
