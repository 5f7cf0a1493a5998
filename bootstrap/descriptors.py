"""Descriptors of a rank's KV memory: pool roles, attention kinds, page
layouts, buffer references, and the pool, state, aux and staging descriptors a
rank registers (inside :class:`bootstrap.messages.RankInfo`). Re-exported
from :mod:`bootstrap.messages`, their public import path."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

from bootstrap.codec import struct

_MAX_NAME = 256


class PoolRole(str, enum.Enum):
    """Which model a KV pool belongs to."""

    TARGET = "target"
    DRAFT = "draft"


class AttentionKind(str, enum.Enum):
    """MHA: K and V per layer, sliced by heads across TP ranks.
    MLA: one latent buffer per layer, identical on every TP rank."""

    MHA = "mha"
    MLA = "mla"


class PageLayout(str, enum.Enum):
    """Order within one page of an MHA buffer. NHD: ``[page_size, heads,
    head_dim]`` (token-major, the common one). HND: ``[heads, page_size,
    head_dim]`` (head-major): a head slice of a page is one contiguous block,
    so heterogeneous TP moves one descriptor per page instead of one per token."""

    NHD = "nhd"
    HND = "hnd"


class Component(str, enum.Enum):
    K = "k"
    V = "v"
    LATENT = "latent"
    KV = "kv"  # K and V fused in one buffer per layer (a pool whose kv_layout is not SPLIT)


class KVLayout(str, enum.Enum):
    """How an MHA pool keeps K and V. SPLIT: a K and a V buffer per layer
    (kvferry's own, SGLang's). The fused kinds have one buffer per layer
    holding both, as vLLM does; a (page, head) or (token, head) unit holds
    ``2 * head_dim`` elements:

    - FUSED_ROWS (vLLM's CPU backend): head-major pages (``page_layout``
      HND); each (page, head) holds ``page_size`` K rows, then ``page_size``
      V rows;
    - FUSED_CELLS (vLLM's GPU backends): each (token, head) cell holds its K
      then its V; pages head-major (HND: vLLM's ``LBHNC``/``BLHNC``) or
      token-major (NHD: ``LBNHC``/``BLNHC``).

    Both sides of a transfer must keep the same kind and page interior: no
    plan turns one into another. Page strides may differ (cross-layer blocks
    to per-layer buffers is an ordinary plan)."""

    SPLIT = "split"
    FUSED_ROWS = "fused_rows"
    FUSED_CELLS = "fused_cells"


#: Field metadata: the codec leaves the field out while it holds its default,
#: so that a peer that predates the field decodes every message not using it.
OMIT_DEFAULT = {"omit_default": True}


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _check_name(name: str, what: str) -> None:
    _require(0 < len(name) <= _MAX_NAME, f"{what} must be 1..{_MAX_NAME} characters")


@struct
@dataclass(frozen=True)
class BufferRef:
    """One registered KV buffer: ``num_pages`` pages of ``page_bytes`` each,
    starting at ``addr`` (a device or host pointer from ``data_ptr()``)."""

    layer: int
    component: Component
    addr: int
    nbytes: int

    def __post_init__(self) -> None:
        _require(self.layer >= 0, f"layer must be >= 0, got {self.layer}")
        _require(0 < self.addr < 1 << 64, "addr must be a non-null 64-bit pointer")
        _require(self.nbytes > 0, f"nbytes must be > 0, got {self.nbytes}")


@struct
@dataclass(frozen=True)
class PoolDescriptor:
    """The layout of one KV pool on one rank.

    Every buffer holds ``num_pages`` pages, page-major. An MHA page of one
    buffer is ``page_size`` tokens x ``num_kv_heads`` heads (the heads this rank
    holds, out of ``total_kv_heads``) x ``head_dim`` elements, ordered as
    ``page_layout`` says. An MLA page is ``page_size`` x ``head_dim`` elements
    (the latent width, ``kv_lora_rank + rope_dim``), with ``num_kv_heads`` 1.
    """

    role: PoolRole
    attention: AttentionKind
    dtype: str
    itemsize: int
    page_size: int
    num_pages: int
    num_layers: int
    num_kv_heads: int
    total_kv_heads: int
    head_dim: int
    page_layout: PageLayout
    buffers: tuple[BufferRef, ...]
    kv_layout: KVLayout = field(default=KVLayout.SPLIT, metadata=OMIT_DEFAULT)
    page_stride_bytes: int = field(default=0, metadata=OMIT_DEFAULT)  # 0: pages are dense (page_bytes apart)

    def __post_init__(self) -> None:
        _check_name(self.dtype, "dtype")
        for name in ("itemsize", "page_size", "num_pages", "num_layers", "num_kv_heads",
                     "total_kv_heads", "head_dim"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        components = self.components
        _require(
            len(self.buffers) == self.num_layers * len(components),
            f"{self.role.value} pool: {len(self.buffers)} buffers for {self.num_layers} layers "
            f"of {'/'.join(c.value for c in components)}",
        )
        seen = {(b.layer, b.component) for b in self.buffers}
        wanted = {(layer, c) for layer in range(self.num_layers) for c in components}
        _require(seen == wanted, f"{self.role.value} pool: buffers must name each (layer, component) once")
        _require(self.page_stride_bytes == 0 or self.page_stride_bytes >= self.page_bytes,
                 f"{self.role.value} pool: page stride {self.page_stride_bytes} below the page's {self.page_bytes} bytes")
        need = (self.num_pages - 1) * self.page_stride + self.page_bytes
        for b in self.buffers:
            _require(
                b.nbytes >= need,
                f"{self.role.value} pool: buffer layer {b.layer} {b.component.value} holds "
                f"{b.nbytes} bytes, less than {self.num_pages} pages of {self.page_bytes} "
                f"(stride {self.page_stride})",
            )
        if self.attention is AttentionKind.MLA:
            _require(self.num_kv_heads == 1 and self.total_kv_heads == 1, "an MLA pool has one latent head")
            _require(self.page_layout is PageLayout.NHD, "an MLA pool has the nhd page layout")
            _require(self.kv_layout is KVLayout.SPLIT, "an MLA pool keeps one latent buffer (kv_layout split)")
        if self.kv_layout is KVLayout.FUSED_ROWS:
            _require(self.page_layout is PageLayout.HND, "a fused_rows pool has head-major (hnd) pages")

    @functools.cached_property  # fields are frozen: computed once (they are asked per room)
    def components(self) -> tuple[Component, ...]:
        """The per-layer buffer components of this pool."""
        if self.kv_layout is not KVLayout.SPLIT:
            return (Component.KV,)
        return _components(self.attention)

    @functools.cached_property
    def head_bytes(self) -> int:
        """Bytes of one head of one token in one buffer (K and V in a fused pool)."""
        return self.head_dim * self.itemsize * (1 if self.kv_layout is KVLayout.SPLIT else 2)

    @functools.cached_property
    def page_stride(self) -> int:
        """Bytes from a page of a buffer to the next one (the page bytes, or
        more where other layers' pages lie between: cross-layer blocks)."""
        return self.page_stride_bytes or self.page_bytes

    @functools.cached_property
    def dense(self) -> bool:
        """Whether consecutive pages of a buffer are contiguous."""
        return self.page_stride == self.page_bytes

    @functools.cached_property
    def token_bytes(self) -> int:
        """Bytes of one token in one buffer."""
        return self.num_kv_heads * self.head_bytes

    @functools.cached_property
    def page_bytes(self) -> int:
        """Bytes of one page in one buffer."""
        return self.page_size * self.token_bytes

    @functools.cached_property
    def _by_key(self) -> dict[tuple[int, Component], BufferRef]:
        return {(b.layer, b.component): b for b in self.buffers}

    def buffer(self, layer: int, component: Component) -> BufferRef:
        try:
            return self._by_key[(layer, component)]
        except KeyError:
            raise KeyError((self.role.value, layer, component.value)) from None


def _components(kind: AttentionKind) -> tuple[Component, ...]:
    return (Component.K, Component.V) if kind is AttentionKind.MHA else (Component.LATENT,)


def components_of(kind: AttentionKind) -> tuple[Component, ...]:
    """The per-layer buffer components of an attention kind."""
    return _components(kind)


@struct
@dataclass(frozen=True)
class AuxDescriptor:
    """One metadata region: ``num_slots`` rows of ``slot_bytes`` at ``addr``.
    One row per request slot (first output token id and the like); a rank may
    have several regions sharing one row index (SGLang's metadata buffers)."""

    addr: int
    slot_bytes: int
    num_slots: int

    def __post_init__(self) -> None:
        _require(0 < self.addr < 1 << 64, "aux addr must be a non-null 64-bit pointer")
        _require(self.slot_bytes > 0 and self.num_slots > 0, "aux slot_bytes and num_slots must be > 0")


@struct
@dataclass(frozen=True)
class StagingDescriptor:
    """A registered staging buffer of ``nbytes`` at ``addr``: scattered pages
    are gathered into it and sent as a few large descriptors. ``arena_bytes``
    (0: one arena of ``nbytes``): a fenced decode rank's staging is a span of
    arenas of this size, registered one by one; a grant never crosses an
    arena's end."""

    addr: int
    nbytes: int
    arena_bytes: int = 0

    def __post_init__(self) -> None:
        _require(0 < self.addr < 1 << 64, "staging addr must be a non-null 64-bit pointer")
        _require(self.nbytes > 0, "staging nbytes must be > 0")
        _require(0 <= self.arena_bytes <= self.nbytes, "staging arena_bytes must be in [0, nbytes]")

    @property
    def arena_size(self) -> int:
        return self.arena_bytes or self.nbytes


class StateSharding(str, enum.Enum):
    """How a state pool lies across the attention TP ranks.
    REPLICATED: the same bytes on every rank (an MLA model's indexer cache):
    one prefill rank sends it to each decode rank. SHARDED: each rank holds
    its own share (a Mamba layer's heads, an MHA sliding window's KV heads):
    rank to rank, between equal TP sizes only."""

    REPLICATED = "replicated"
    SHARDED = "sharded"


@struct
@dataclass(frozen=True)
class StateBuffer:
    """One registered state buffer: ``num_items`` items of ``item_bytes`` at ``addr``.

    How a sharded state's item splits over the TP ranks (its slice axis),
    for a move between different TP sizes: ``slice_outer`` rows, each of
    ``slice_dim`` units of this rank's share of the axis (a unit is
    ``item_bytes / (slice_outer * slice_dim)`` bytes: a head's bytes of one
    token of a sliding-window page, a Mamba head's state); ``slice_groups``:
    the axis' sub-blocks over all ranks, each split over the ranks on its
    own (a GDN conv state's query, key and value channels; empty: one block).
    ``slice_dim`` 0: no slice axis: the item moves whole (from one rank)."""

    addr: int
    item_bytes: int
    num_items: int
    slice_dim: int = field(default=0, metadata=OMIT_DEFAULT)
    slice_outer: int = field(default=1, metadata=OMIT_DEFAULT)
    slice_groups: tuple[int, ...] = field(default=(), metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        _require(0 < self.addr < 1 << 64, "state buffer addr must be a non-null 64-bit pointer")
        _require(self.item_bytes > 0 and self.num_items > 0, "state buffer item_bytes and num_items must be > 0")
        _require(self.slice_dim >= 0 and self.slice_outer >= 1 and all(g > 0 for g in self.slice_groups),
                 "state buffer slice_dim >= 0, slice_outer >= 1 and slice_groups > 0")
        _require(self.slice_dim == 0 or self.item_bytes % (self.slice_dim * self.slice_outer) == 0,
                 f"state buffer: items of {self.item_bytes} bytes are not {self.slice_outer} rows of "
                 f"{self.slice_dim} units")

    @property
    def unit_bytes(self) -> int:
        """Bytes of one unit of the slice axis (0 without one)."""
        return self.item_bytes // (self.slice_dim * self.slice_outer) if self.slice_dim else 0


@struct
@dataclass(frozen=True)
class StatePoolDescriptor:
    """A per-request state pool beside the KV pools (SGLang's state types:
    Mamba slots, sliding-window pages, DSA indexer pages...): ``kind`` names
    it (the engine's name), each request names its own item indices in it,
    and item ``i`` of prefill's list goes to item ``i`` of decode's, in every
    buffer, with the room's last chunk. ``exact``: the two lists must be as
    long as each other (slot- and row-indexed states); otherwise the longer
    is cut to the shorter (page-indexed states, whose two sides may count a
    page more or less at a window's edge, as the engine's own backends allow)."""

    kind: str
    sharding: StateSharding
    exact: bool
    buffers: tuple[StateBuffer, ...]

    def __post_init__(self) -> None:
        _check_name(self.kind, "state kind")
        _require(bool(self.buffers), f"state pool {self.kind}: no buffers")

    @functools.cached_property
    def item_bytes(self) -> int:
        """Bytes of one item in all buffers together (what one item costs packed)."""
        return sum(b.item_bytes for b in self.buffers)

    @functools.cached_property
    def num_items(self) -> int:
        """Items every buffer holds (the smallest buffer's count)."""
        return min(b.num_items for b in self.buffers)
