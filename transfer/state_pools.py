"""Per-request state pools beside the KV pools: tensors (or raw pointers) in,
descriptors out.

Models PD serves in 2026 carry state that is not KV pages of the request's
page list: a Mamba/GDN layer's conv and SSM state (one slot per request), a
sliding-window layer's KV (its own page ids, the window only), DeepSeek's
sparse-attention indexer cache (pages of its own buffers)... Each is a
:class:`StatePool`: a kind (the engine's name for it), buffers of
``[num_items, ...]`` (one item per row, rows contiguous), how it lies across
TP ranks, and whether the two sides' index lists must be equally long. A
request names its own item indices in each; item ``i`` of prefill's list
goes to item ``i`` of decode's, in every buffer, with the room's last chunk
(:mod:`transfer.plan`'s :func:`~transfer.plan.plan_state`).

No state byte is copied here: the tensors are the engine's memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

from bootstrap.messages import StateBuffer, StatePoolDescriptor, StateSharding
from transfer.raw_pools import wrap_pointer


@dataclass(frozen=True)
class StatePool:
    """One state pool: ``buffers`` are tensors ``[num_items, ...]`` (contiguous,
    on the KV pools' device), item ``j`` of a buffer being its row ``j``.
    ``sharding``: :class:`~bootstrap.messages.StateSharding` (or its value).
    ``exact``: a request's prefill and decode index lists must be as long as
    each other (slot- and row-indexed states); False cuts the longer one to
    the shorter (page-indexed states)."""

    kind: str
    buffers: Sequence[Any]
    sharding: StateSharding | str = StateSharding.SHARDED
    exact: bool = True
    #: per buffer (or empty: none), its slice axis ``(slice_dim, slice_outer, slice_groups)`` or None (see
    #: :class:`~bootstrap.messages.StateBuffer`): lets a sharded state move between different TP sizes
    slicing: Sequence[tuple | None] = ()


@dataclass(frozen=True, kw_only=True)
class RawStatePool:
    """A state pool as raw buffers (SGLang's ``state_data_ptrs/lens/item_lens``
    of one state type): ``addrs``/``nbytes``/``item_bytes`` one entry per buffer."""

    kind: str
    addrs: Sequence[int]
    nbytes: Sequence[int]
    item_bytes: Sequence[int]
    sharding: StateSharding | str = StateSharding.SHARDED
    exact: bool = True
    device: str = "cpu"
    slicing: Sequence[tuple | None] = ()

    def __post_init__(self) -> None:
        n = len(self.addrs)
        if not n or len(self.nbytes) != n or len(self.item_bytes) != n:
            raise ValueError(f"state pool {self.kind}: addrs, nbytes and item_bytes must be non-empty and of one "
                             f"length ({len(self.addrs)}, {len(self.nbytes)}, {len(self.item_bytes)})")
        for i, (a, nb, ib) in enumerate(zip(self.addrs, self.nbytes, self.item_bytes, strict=True)):
            if not 0 < a < 1 << 64 or ib <= 0 or nb < ib:
                raise ValueError(f"state pool {self.kind} buffer {i}: addr {a:#x}, {nb} bytes, items of {ib} bytes: "
                                 "need a non-null pointer and at least one item")


def state_pool_from_pointers(raw: RawStatePool) -> StatePool:
    """A :class:`StatePool` whose buffers view the raw memory as ``uint8
    [num_items, item_bytes]`` (no byte copied; the memory must outlive it)."""
    buffers = []
    for a, nb, ib in zip(raw.addrs, raw.nbytes, raw.item_bytes, strict=True):
        items = nb // ib
        buffers.append(wrap_pointer(a, items * ib, "uint8", raw.device).view(items, ib))
    return StatePool(kind=raw.kind, buffers=tuple(buffers), sharding=raw.sharding, exact=raw.exact,
                     slicing=tuple(raw.slicing))


def state_rows(pool: StatePool) -> tuple:
    """Each buffer as ``uint8 [num_items, item_bytes]`` (views, no copy)."""
    import torch

    out = []
    for i, t in enumerate(pool.buffers):
        if t.dim() < 1 or not t.is_contiguous() or t.shape[0] < 1:
            raise ValueError(f"state pool {pool.kind} buffer {i}: must be a contiguous tensor [num_items, ...]")
        out.append(t.reshape(t.shape[0], -1).view(torch.uint8))
    return tuple(out)


def describe_state(pool: StatePool) -> StatePoolDescriptor:
    """The wire descriptor of a state pool; ValueError on an unusable buffer."""
    rows = state_rows(pool)
    slicing = list(pool.slicing) or [None] * len(rows)
    if len(slicing) != len(rows):
        raise ValueError(f"state pool {pool.kind}: {len(slicing)} slicings for {len(rows)} buffers")
    buffers = []
    for r, sl in zip(rows, slicing, strict=True):
        dim, outer, groups = sl if sl is not None else (0, 1, ())
        buffers.append(StateBuffer(addr=r.data_ptr(), item_bytes=int(r.shape[1]), num_items=int(r.shape[0]),
                                   slice_dim=int(dim), slice_outer=int(outer), slice_groups=tuple(int(g) for g in groups or ())))
    return StatePoolDescriptor(kind=pool.kind, sharding=StateSharding(pool.sharding), exact=bool(pool.exact),
                               buffers=tuple(buffers))


def state_regions(states: Sequence[StatePool]) -> list[tuple[int, int]]:
    """(addr, nbytes) of every state buffer, to register with the transport."""
    return [(r.data_ptr(), r.numel()) for s in states for r in state_rows(s)]
