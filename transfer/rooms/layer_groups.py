"""Layer-wise sends: a chunk sent as layer groups while the forward pass goes
on. Pure: numpy only.

A room's layers are numbered across its pools, the target pool's first, then
the draft pool's (``layer_spans``): with a 32-layer target and a 1-layer
draft, layers 0-31 are the target's and 32 the draft's. ``KVSender.send(pages,
layers=...)`` sends those layers of a chunk's pages; the chunk is complete
once every layer was sent, in any number of groups, in any order, each layer
once, every group naming the same pages and the same ``last``. Only then does
the room move on to its next chunk, and only the last chunk's completing group
ends the room (its aux row and state items go with that group).

:class:`ChunkGroups` keeps one chunk's groups; :func:`by_pool` turns a group's
room layers into each pool's own layer indices (what the planner takes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bootstrap.messages import PoolRole


def layer_spans(pools: Sequence) -> tuple[tuple[PoolRole, int, int], ...]:
    """(role, first room layer, layers) of each pool (``PoolDescriptor``s, in order)."""
    out, start = [], 0
    for pool in pools:
        out.append((pool.role, start, int(pool.num_layers)))
        start += int(pool.num_layers)
    return tuple(out)


def num_layers(spans) -> int:
    return sum(n for _, _, n in spans)


def by_pool(layers: np.ndarray, spans) -> dict[PoolRole, tuple[int, ...]]:
    """Each pool's own layer indices among room ``layers``."""
    out = {}
    for role, start, n in spans:
        own = layers[(layers >= start) & (layers < start + n)] - start
        out[role] = tuple(int(i) for i in own)
    return out


def room_layers(layers, spans) -> tuple[int, ...]:
    """Each pool's own layer indices (by role, as :func:`by_pool` gives them)
    as room layers, ascending: the inverse of :func:`by_pool`."""
    return tuple(start + int(i) for role, start, _ in spans for i in sorted(layers.get(role, ())))


def parse_layers(layers, total: int) -> np.ndarray:
    """``layers`` (a range, a slice-free iterable of ints) as a sorted array
    of distinct room layers; ValueError naming what is wrong."""
    arr = np.asarray(list(layers), dtype=np.int64).reshape(-1)
    if arr.size == 0:
        raise ValueError("a layer group names no layer")
    if arr.min() < 0 or arr.max() >= total:
        raise ValueError(f"layers {arr.min()}..{arr.max()} outside the room's {total} layers (target, then draft)")
    uniq = np.unique(arr)
    if uniq.size != arr.size:
        raise ValueError("a layer group names a layer twice")
    return uniq


class ChunkGroups:
    """The layer groups of one chunk sent so far."""

    def __init__(self, pages: np.ndarray, last: bool, total: int) -> None:
        self.pages, self.last = pages, bool(last)
        self.sent = np.zeros(total, dtype=bool)
        #: the room is shorter than ``layerwise_min_tokens``: its groups are held and the chunk goes whole
        #: (gated on its completing group's ready event: a chunk's groups come from one stream, in order)
        self.deferred = False
        self.states: tuple = ()  # state indices a group gave (the last chunk's): sent with its completing group

    def add(self, pages: np.ndarray, last: bool, layers: np.ndarray) -> None:
        """Record a group; ValueError when it does not belong to this chunk
        (other pages or ``last``) or repeats a layer."""
        if pages.size != self.pages.size or not np.array_equal(pages, self.pages):
            raise ValueError(f"a layer group names other pages ({pages.size}) than its chunk's first group "
                             f"({self.pages.size}); finish the chunk's layers first")
        if bool(last) != self.last:
            raise ValueError(f"a layer group says last={bool(last)}, its chunk's first group last={self.last}")
        again = layers[self.sent[layers]]
        if again.size:
            raise ValueError(f"layer(s) {again[:8].tolist()} of this chunk were sent already")
        self.sent[layers] = True

    @property
    def complete(self) -> bool:
        return bool(self.sent.all())

    def missing(self) -> list[int]:
        return np.flatnonzero(~self.sent).tolist()
