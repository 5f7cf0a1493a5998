"""``python -m benchmarks --storage``: the storage tier's backends, write-through
and prefetch, side by side with the machine's limits, in one run.

Each backend (``file`` in a temporary directory; ``mooncake``, a Mooncake
Store whose master and holder process this run starts on 127.0.0.1 and stops;
``nixl`` on NIXL's POSIX plugin in a temporary directory, skipped with the
reason where NIXL does not import) gets a fresh store and fresh keys, and
moves pages of a Llama-8B-like MHA pool (32 layers, K and V, 8 heads of 128,
bf16, page size 16: 64 blocks of 32 KiB, 2 MiB a page) in CPU tensors of
random bytes, registered with ``register_memory(pool_regions(pool))``:

- **write-through**: pages of a source pool at random indices, stored under
  the keys of random prompts (:mod:`transfer.storage.keys`), as the tier
  writes them: per batch of :data:`transfer.storage.tier.BATCH_PAGES` pages an
  ``exists`` and a ``put`` of the rest;
- **prefetch**: as the tier reads them: one ``exists`` over a prompt's keys,
  then a ``get_into`` per batch into random pages of a second pool. A sample
  of pages is compared byte for byte after the timed part.

Limits of the same bytes, rows of mode ``limit``: a memcpy (per batch, the
batch's pages of every block, pool to pool, numpy on one thread) and, for the
file and NIXL stores, the file system's, measured in the store's directory
just before it (one file per page, a plain ``writev`` / ``readv`` of its
blocks: no header, checksum or rename). Those stores and their limit run at
page-cache speed; before each timed write into the page cache the run
touches and frees as much memory (:func:`recycle_memory`).
p50/p99 are per batch call.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.page_cache import recycle_memory
from benchmarks.workloads import MODELS, PAGE_SIZE
from transfer.pools import MHAPool
from transfer.storage.base import open_storage
from transfer.storage.keys import chain_hashes, keys_from_chain
from harness.local_mooncake import LocalMooncake, mooncake_missing_reason
from transfer.storage.nixl.probe import nixl_missing_reason
from transfer.storage.segments import page_bytes, pages_segments, pool_fingerprint, pool_regions
from transfer.storage.tier import BATCH_PAGES

BACKENDS = ("file", "mooncake", "nixl")
DEFAULT_PAGES = 384
PROMPT_PAGES = 512  # pages of a random prompt (8k tokens; a multiple of BATCH_PAGES): one hash chain
VOCAB = 128_256
CALL_TIMEOUT_S = 60.0  # a network backend's bound on one call
PAGE_CACHE_BACKENDS = ("file", "nixl")  # stores whose writes land in this host's page cache


@dataclass(frozen=True, kw_only=True)
class StorageBenchConfig:
    """``num_pages`` per backend (each run of each backend writes and reads
    them all); ``verify_pages`` of them are compared after a backend's run;
    ``seed`` draws the bytes, the prompts and the page orders."""

    num_pages: int = DEFAULT_PAGES
    backends: tuple[str, ...] = BACKENDS
    verify_pages: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        unknown = set(self.backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"unknown storage backends {sorted(unknown)} (known: {', '.join(BACKENDS)})")


# --- pools -------------------------------------------------------------------------------------


class Pool:
    """An MHA pool of the Llama-8B-like geometry over numpy memory; ``blocks``
    are its tensors as ``[num_pages, block_bytes]`` uint8 arrays, in the
    storage order (layer 0 K, layer 0 V, layer 1 K, ...)."""

    def __init__(self, num_pages: int, rng: np.random.Generator | None) -> None:
        """Random bytes from ``rng``, or zeros without one."""
        spec = MODELS["llama8b"]
        shape = (num_pages, PAGE_SIZE, spec.total_heads, spec.head_dim)
        words = num_pages * PAGE_SIZE * spec.total_heads * spec.head_dim // 4  # bf16: 4 per uint64
        self.blocks: list[np.ndarray] = []
        tensors = []
        for _ in range(2 * spec.num_layers):
            raw = rng.integers(0, 2**64, words, dtype=np.uint64) if rng else np.zeros(words, dtype=np.uint64)
            self.blocks.append(raw.view(np.uint8).reshape(num_pages, -1))
            tensors.append(torch.from_numpy(raw).view(torch.bfloat16).view(shape))
        self.pool = MHAPool(k=tensors[0::2], v=tensors[1::2])
        self.page_bytes = page_bytes(self.pool)

    def zero(self) -> None:
        for block in self.blocks:
            block.fill(0)


@dataclass(frozen=True)
class Bench:
    """What every measurement of one run shares: the source pool (random
    bytes), the destination pool, and the run's random numbers."""

    config: StorageBenchConfig
    src: Pool
    dst: Pool
    rng: np.random.Generator

    @property
    def num_pages(self) -> int:
        return self.config.num_pages

    def same_pages(self, src_pages: list[int], dst_pages: list[int]) -> bool:
        """Whether a sample of ``src_pages[i]`` equals ``dst_pages[i]``, byte for byte."""
        sample = self.rng.choice(len(src_pages), min(len(src_pages), self.config.verify_pages), replace=False)
        return all(np.array_equal(s[src_pages[i]], d[dst_pages[i]]) for i in sample
                   for s, d in zip(self.src.blocks, self.dst.blocks))


# --- rows --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One timed section: ``pages`` pages of ``page_bytes`` in ``seconds``,
    ``batch_ms`` per batch call of up to ``BATCH_PAGES`` pages."""

    workload: str
    mode: str  # "storage" or "limit"
    backend: str
    op: str
    pages: int
    page_bytes: int
    seconds: float
    batch_ms: list[float]
    descriptors_per_batch: int = 0

    def row(self) -> dict:
        """The JSON row, with the transfer rows' fields (a batch call as the "request")."""
        nbytes = self.pages * self.page_bytes
        ms = self.batch_ms or [0.0]
        return {"workload": self.workload, "mode": self.mode, "backend": self.backend, "op": self.op,
                "tokens": self.pages * PAGE_SIZE, "concurrency": 1, "pages": self.pages,
                "batch_pages": BATCH_PAGES, "bytes": nbytes,
                "gbps": round(nbytes / self.seconds / 1e9, 3) if self.seconds else 0.0,
                "pages_per_s": round(self.pages / self.seconds, 1) if self.seconds else 0.0,
                "p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
                "descriptors_per_request": self.descriptors_per_batch}


def _batches(num_pages: int) -> list[tuple[int, int]]:
    return [(b, min(num_pages, b + BATCH_PAGES)) for b in range(0, num_pages, BATCH_PAGES)]


def _timed(batches: list[tuple[int, int]], step) -> tuple[float, list[float]]:
    """``step(begin, end)`` for every batch: (total seconds, per-batch ms)."""
    batch_ms = []
    t0 = time.perf_counter()
    for b, e in batches:
        started = time.perf_counter()
        step(b, e)
        batch_ms.append((time.perf_counter() - started) * 1e3)
    return time.perf_counter() - t0, batch_ms


# --- a backend's write-through and prefetch ----------------------------------------------------


def _keys(bench: Bench, num_pages: int) -> list[str]:
    """Fresh keys of ``num_pages`` pages: the hash chains of random prompts
    of up to ``PROMPT_PAGES`` pages, bound to the pool's fingerprint."""
    fingerprint = pool_fingerprint(bench.src.pool, model="kvferry-bench-llama8b")
    keys: list[str] = []
    while len(keys) < num_pages:
        tokens = bench.rng.integers(0, VOCAB, min(PROMPT_PAGES, num_pages - len(keys)) * PAGE_SIZE)
        keys += keys_from_chain(fingerprint, chain_hashes(tokens, PAGE_SIZE))
    return keys


def _write_through(store, keys: list[str], pool: Pool, pages: list[int]) -> tuple[float, list[float]]:
    """As ``StorageTier.write`` stores pages: per batch, ``exists`` and a ``put`` of the rest."""
    def step(b: int, e: int) -> None:
        present = store.exists(keys[b:e])  # fresh keys: 0
        ok = store.put(keys[b + present:e], pages_segments(pool.pool, pages[b + present:e]))
        if not all(ok):
            raise RuntimeError(f"{store.url}: put stored {sum(ok)} of {len(ok)} pages")
    return _timed(_batches(len(keys)), step)


def _prefetch(store, keys: list[str], pool: Pool, pages: list[int]) -> tuple[float, list[float]]:
    """As ``StorageTier.read`` loads pages: ``exists`` over a prompt's keys,
    then a ``get_into`` per batch (a prompt's ``exists`` is timed with its first batch)."""
    def step(b: int, e: int) -> None:
        if b % PROMPT_PAGES == 0:
            prompt = keys[b:b + PROMPT_PAGES]
            if (found := store.exists(prompt)) != len(prompt):
                raise RuntimeError(f"{store.url}: only {found} of {len(prompt)} written pages exist")
        ok = store.get_into(keys[b:e], pages_segments(pool.pool, pages[b:e]))
        if not all(ok):
            raise RuntimeError(f"{store.url}: get_into loaded {sum(ok)} of {len(ok)} pages")
    return _timed(_batches(len(keys)), step)


def run_backend(bench: Bench, name: str, url: str) -> list[dict]:
    """One backend's write-through and prefetch rows; RuntimeError when a
    page is not stored, not loaded, or loaded with other bytes."""
    n, src, dst = bench.num_pages, bench.src, bench.dst
    src_pages, dst_pages = bench.rng.permutation(n).tolist(), bench.rng.permutation(n).tolist()
    dst.zero()
    with open_storage(url) as store:
        store.register_memory(pool_regions(src.pool) + pool_regions(dst.pool))
        warm = _keys(bench, 1)  # a first call pays set-up (connections, NIXL's first transfer)
        _write_through(store, warm, src, src_pages)
        _prefetch(store, warm, dst, dst_pages)
        dst.zero()
        keys = _keys(bench, n)
        if name in PAGE_CACHE_BACKENDS:
            recycle_memory(n * src.page_bytes)
        write_s, write_ms = _write_through(store, keys, src, src_pages)
        read_s, read_ms = _prefetch(store, keys, dst, dst_pages)
    if not bench.same_pages(src_pages, dst_pages):
        raise RuntimeError(f"{name}: prefetched pages differ from the pages written")
    common = dict(backend=name, pages=n, page_bytes=src.page_bytes,
                  descriptors_per_batch=BATCH_PAGES * len(src.blocks))  # a full batch's blocks
    return [Measured(workload=f"storage-{name}-write", mode="storage", op="write-through", seconds=write_s,
                     batch_ms=write_ms, **common).row(),
            Measured(workload=f"storage-{name}-prefetch", mode="storage", op="prefetch", seconds=read_s,
                     batch_ms=read_ms, **common).row()]


# --- limits ------------------------------------------------------------------------------------


def memcpy_limit(bench: Bench) -> dict:
    """Per batch, its pages of every block copied pool to pool (numpy, one thread)."""
    src, dst = bench.src, bench.dst

    def step(b: int, e: int) -> None:
        for s, d in zip(src.blocks, dst.blocks):
            np.copyto(d[b:e], s[b:e])
    seconds, batch_ms = _timed(_batches(bench.num_pages), step)
    return Measured(workload="storage-memcpy", mode="limit", backend="memcpy", op="copy", pages=bench.num_pages,
                    page_bytes=src.page_bytes, seconds=seconds, batch_ms=batch_ms).row()


def fs_limits(bench: Bench, name: str, directory: Path) -> list[dict]:
    """The file system under backend ``name``'s store, measured just before
    it: one file per page in ``directory``, a plain ``writev`` of its blocks,
    then a ``readv`` into the other pool (no header, checksum or rename);
    the files are deleted after."""
    n, src, dst = bench.num_pages, bench.src, bench.dst
    directory.mkdir()
    paths = [directory / f"page-{p}" for p in range(n)]

    def io(write: bool):
        def step(b: int, e: int) -> None:
            for p in range(b, e):
                fd = os.open(paths[p], os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY, 0o600)
                try:
                    done = os.writev(fd, [s[p] for s in src.blocks]) if write else \
                        os.readv(fd, [d[p] for d in dst.blocks])
                finally:
                    os.close(fd)
                if done != src.page_bytes:
                    raise RuntimeError(f"{'writev' if write else 'readv'} of a page moved {done} of {src.page_bytes}")
        return _timed(_batches(n), step)

    try:
        recycle_memory(n * src.page_bytes)
        write_s, write_ms = io(True)
        read_s, read_ms = io(False)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    common = dict(mode="limit", backend=name, pages=n, page_bytes=src.page_bytes)
    return [Measured(workload=f"storage-{name}-fs-write", op="fs-write", seconds=write_s, batch_ms=write_ms,
                     **common).row(),
            Measured(workload=f"storage-{name}-fs-read", op="fs-read", seconds=read_s, batch_ms=read_ms,
                     **common).row()]


# --- the run -----------------------------------------------------------------------------------


_MISSING = {"mooncake": mooncake_missing_reason, "nixl": nixl_missing_reason}


def _run_named(bench: Bench, name: str, directory: Path) -> list[dict]:
    """Start backend ``name``'s store in ``directory``, measure it (and, for
    a file system store, the file system's limits first), remove it."""
    directory.mkdir()
    try:
        if name == "mooncake":
            holder_bytes = (bench.num_pages + 1) * bench.src.page_bytes * 5 // 4 + (64 << 20)
            cluster = LocalMooncake(directory, holder_bytes=holder_bytes)
            try:
                return run_backend(bench, name, f"{cluster.url}&call_timeout_s={CALL_TIMEOUT_S}")
            finally:
                cluster.close()
        limits = fs_limits(bench, name, directory / "fs-limit")
        url = f"file://{directory}" if name == "file" else \
            f"nixl://{directory}?backend=POSIX&xfer_timeout_s={CALL_TIMEOUT_S}"
        return run_backend(bench, name, url) + limits
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_storage(config: StorageBenchConfig) -> tuple[list[dict], dict[str, str]]:
    """Rows of every backend that can run here and of the limits, and the
    reason each other backend was skipped. Everything it starts or writes
    (the Mooncake processes, temporary directories) is gone when it returns."""
    rng = np.random.default_rng(config.seed)
    bench = Bench(config, Pool(config.num_pages, rng), Pool(config.num_pages, None), rng)
    bench.dst.zero()  # first touch, before anything is timed
    memcpy = memcpy_limit(bench)
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-storage-") as tmp:
        for name in config.backends:
            reason = _MISSING[name]() if name in _MISSING else ""
            if reason:
                skipped[name] = reason
                print(f"storage: {name} skipped: {reason}", flush=True)
                continue
            rows += _run_named(bench, name, Path(tmp) / name)
    return rows + [memcpy], skipped


def print_table(rows: list[dict]) -> None:
    """Rows of :func:`run_storage`; a storage row's note compares it with the limits."""
    gbps = {r["workload"]: r["gbps"] for r in rows}
    head = f"{'workload':<26} {'mode':<7} {'pages':>5} {'pages/s':>8} {'GB/s':>6} {'p50 ms':>8} {'p99 ms':>8}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        if r["mode"] == "storage":
            op = "write" if r["op"] == "write-through" else "read"
            refs = {"memcpy": gbps.get("storage-memcpy"), f"fs {op}": gbps.get(f"storage-{r['backend']}-fs-{op}")}
            note = ", ".join(f"{r['gbps'] / v:.0%} of {k}" for k, v in refs.items() if v)
        else:
            note = "numpy copy, pool to pool" if r["backend"] == "memcpy" else \
                f"{r['op'].removeprefix('fs-')}v, a file per page, next to the {r['backend']} store"
        print(f"{r['workload']:<26} {r['mode']:<7} {r['pages']:>5} {r['pages_per_s']:>8.1f} {r['gbps']:>6.2f} "
              f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}  {note}", flush=True)
