"""The pages a kvferry request of a benchmark workload writes, for the raw
same-pages baseline (``python -m benchmarks.raw mc-pages``). Pure: numpy only.

Geometry: a pool side is an arena holding one region per buffer (per layer a
K and a V region of ``[num_pages, page_size, heads, head_dim]``, or one
latent region for MLA), back to back in the order kvferry lists them (pool,
layer, component). Page ``p`` of buffer ``b`` starts at
``region_offset[b] + p * page_bytes[b]``. Regions of one arena instead of
separate allocations change no descriptor: runs are merged within a buffer
only.

Page choice mirrors ``harness.workload`` exactly (same seeds, same order):
``room_source_pages`` is ``room_plan``'s page list and :class:`DecodeAllocator`
its decode-side free list for scattered placement, so with the benchmark's
spec the raw sender writes the very pages kvferry's ranks write. A test
checks the mirror against ``harness.workload``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1}
CANARY_PAGES = 4  # harness.workload keeps the last 4 decode pages out of the allocator


@dataclass(frozen=True)
class ArenaLayout:
    """One side's pool buffers as regions of one arena."""

    page_bytes: tuple[int, ...]  # per buffer, in kvferry's order
    num_pages: int

    @property
    def region_offsets(self) -> np.ndarray:
        sizes = np.array(self.page_bytes, dtype=np.int64) * self.num_pages
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

    @property
    def arena_bytes(self) -> int:
        return sum(self.page_bytes) * self.num_pages

    @property
    def request_page_bytes(self) -> int:
        """Bytes one page id stands for, over every buffer."""
        return sum(self.page_bytes)


def parse_buffers(text: str) -> tuple[int, ...]:
    """``"64x32768,2x4096"`` (count x page bytes, comma-separated groups) ->
    the per-buffer page sizes."""
    out: list[int] = []
    for group in text.split(","):
        count, _, nbytes = group.partition("x")
        if not nbytes or int(count) <= 0 or int(nbytes) <= 0:
            raise ValueError(f"buffer group {group!r} is not COUNTxPAGE_BYTES")
        out.extend([int(nbytes)] * int(count))
    return tuple(out)


def format_buffers(page_bytes: tuple[int, ...]) -> str:
    groups: list[list[int]] = []
    for n in page_bytes:
        if groups and groups[-1][1] == n:
            groups[-1][0] += 1
        else:
            groups.append([1, n])
    return ",".join(f"{c}x{n}" for c, n in groups)


def _rng(*key: int | str) -> np.random.Generator:
    # harness.workload._rng
    return np.random.default_rng([int.from_bytes(hashlib.sha256(k.encode()).digest()[:8], "little")
                                  if isinstance(k, str) else k for k in key])


@dataclass(frozen=True)
class PageDraw:
    """The workload parameters that choose pages (``harness.workload.Spec``'s)."""

    seed: int
    min_tokens: int
    max_tokens: int
    page_size: int
    prefill_pages: int
    decode_pages: int


def room_source_pages(draw: PageDraw, room: int) -> np.ndarray:
    """A room's prefill pages, scattered placement (``room_plan``)."""
    rng = _rng(draw.seed, "room", room)
    tokens = int(rng.integers(draw.min_tokens, draw.max_tokens + 1))
    n = -(-tokens // draw.page_size)
    return rng.permutation(draw.prefill_pages)[:n]


class DecodeAllocator:
    """Decode rank 0's free list, scattered placement (``run_decode``):
    ``take`` pops pages off the end, ``give_back`` appends them."""

    def __init__(self, draw: PageDraw, rank: int = 0) -> None:
        rng = _rng(draw.seed, "decode-alloc", rank)
        self._free = [int(x) for x in rng.permutation(draw.decode_pages - CANARY_PAGES)]

    def take(self, num_pages: int) -> list[int]:
        if len(self._free) < num_pages:
            raise ValueError(f"decode pool has {len(self._free)} free pages, a request needs {num_pages}")
        return [self._free.pop() for _ in range(num_pages)]

    def give_back(self, pages: list[int]) -> None:
        self._free.extend(pages)


def page_descriptors(src: ArenaLayout, dst: ArenaLayout, src_base_addr: int, dst_base_addr: int,
                     src_pages, dst_pages) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_addrs, dst_addrs, lengths) writing ``src_pages[i]`` of every
    buffer onto ``dst_pages[i]``: one descriptor per run of pages adjacent on
    both sides, per buffer, buffers in order."""
    if src.page_bytes != dst.page_bytes:
        raise ValueError("source and destination buffers differ in page size")
    s = np.asarray(src_pages, dtype=np.int64)
    d = np.asarray(dst_pages, dtype=np.int64)
    if len(s) != len(d):
        raise ValueError(f"{len(s)} source pages for {len(d)} destination pages")
    if len(s) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    run_pages = np.diff(np.concatenate([starts, [len(s)]]))
    page_bytes = np.array(src.page_bytes, dtype=np.int64)[:, None]
    src_addrs = src_base_addr + src.region_offsets[:, None] + s[starts][None, :] * page_bytes
    dst_addrs = dst_base_addr + dst.region_offsets[:, None] + d[starts][None, :] * page_bytes
    lengths = run_pages[None, :] * page_bytes
    return src_addrs.ravel(), dst_addrs.ravel(), lengths.ravel()
