"""How a batch of keys becomes Mooncake Store calls (pure).

A value spread over many buffers moves in one multi-buffer call per run of
keys; the TCP transport rejects, and may wedge on, more buffers per call than
its per-peer queue holds, so runs carry at most ``max_entries`` buffers.
Overwrites have no multi-buffer call: their segments are gathered into one
host bounce buffer, so their runs also fit its capacity."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from transfer.storage.base import Segment

__all__ = ["bounce_batches", "entry_chunks", "pointers_and_sizes"]


def pointers_and_sizes(chunk: Sequence[int], segments: Sequence[Sequence[Segment]]):
    """The multi-buffer calls' per-key lists of addresses and of sizes."""
    return [[a for a, _ in segments[i]] for i in chunk], [[n for _, n in segments[i]] for i in chunk]


def entry_chunks(indices: Iterable[int], segments: Sequence[Sequence[Segment]],
                 max_entries: int) -> Iterator[list[int]]:
    """Runs of ``indices`` with at most ``max_entries`` buffers (at least one key)."""
    chunk, entries = [], 0
    for i in indices:
        if chunk and entries + len(segments[i]) > max_entries:
            yield chunk
            chunk, entries = [], 0
        chunk.append(i)
        entries += len(segments[i])
    if chunk:
        yield chunk


def bounce_batches(indices: Iterable[int], totals: Sequence[int], capacity_bytes: int,
                   max_entries: int) -> Iterator[list[int]]:
    """Runs of ``indices`` whose values (``totals[i]`` bytes) fit ``capacity_bytes``
    together, at most ``max_entries`` keys each (a value larger than the
    capacity never occurs: the bounce buffer is grown to the largest first)."""
    chunk, used = [], 0
    for i in indices:
        if chunk and (used + totals[i] > capacity_bytes or len(chunk) >= max_entries):
            yield chunk
            chunk, used = [], 0
        chunk.append(i)
        used += totals[i]
    if chunk:
        yield chunk
