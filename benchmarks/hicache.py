"""``python -m benchmarks.hicache`` (``make bench-hicache``, in SGLang's
environment): kvferry's store as SGLang's HiCache L3 backend
(:mod:`transfer.adapters.sglang.hicache`) beside SGLang's own file backend
(``HiCacheFile``, ``--hicache-storage-backend file``), on the same pages of
SGLang's own host pool, in one run.

The pool: SGLang 0.5.23's ``MHATokenToKVPoolHost``, ``page_first``, of a
Llama-8B-like model (32 layers, 8 KV heads of 128, bf16) with pages of 16
tokens: 2 MiB a page, its K and V of every layer in two blocks of 1 MiB.
Built unpinned on the CPU (SGLang pins host pools through CUDA). Pages at
random host indices, random bytes, keys SGLang's own page hashes of a random
prompt (``get_hash_str``).

Each backend is called as SGLang's cache controller calls it
(``managers/cache_controller.py``), in batches of 128 pages
(``STORAGE_BATCH_SIZE``):

- ``sglang-file``: the generic path SGLang takes for ``HiCacheFile`` (it has
  no zero-copy calls): a backup is ``get_data_page`` of every page then
  ``batch_set`` (``_generic_page_set``); a prefetch is ``batch_get`` into
  ``get_dummy_flat_data_page`` buffers, then ``set_from_flat_data_page``
  (``_generic_page_get``);
- ``kvferry-file``, ``kvferry-mooncake``, ``kvferry-nixl``: kvferry's
  backend with ``interface_v1`` (``_page_set_zero_copy`` /
  ``_page_get_zero_copy``: ``batch_set_v1`` / ``batch_get_v1`` with host
  indices), over kvferry's file store, a Mooncake Store whose master and
  holder this run starts on 127.0.0.1 (every byte over the Store's TCP
  transport), and NIXL's POSIX plugin; a backend that cannot run here is
  skipped with the reason.

Every backend gets a fresh directory (or Store) and writes every page, then
reads every page into other random pages of a second host pool, cleared
first; every page read is then compared with its source, byte for byte (a
mismatch fails the run). The file stores write into the page cache (nothing
is fsync-ed by either), so before each timed write the run touches and frees
as much memory (:func:`benchmarks.page_cache.recycle_memory`). Backends run in
turn, ``rounds`` times. A ``memcpy`` row (the pages pool to pool, per batch)
is the machine's limit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.server_runs import percentile, rewrite_block
from benchmarks.page_cache import recycle_memory

BACKENDS = ("sglang-file", "kvferry-file", "kvferry-mooncake", "kvferry-nixl")
BATCH_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE
DOC_BLOCK = "bench-hicache"


@dataclass(frozen=True, kw_only=True)
class HiCacheBenchConfig:
    """The pool's shape and how many pages each backend moves per round."""

    num_pages: int = 512
    page_tokens: int = 16
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    rounds: int = 3
    backends: tuple[str, ...] = BACKENDS
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_pages < 1 or self.rounds < 1:
            raise ValueError(f"num_pages and rounds must be >= 1, got {self.num_pages}, {self.rounds}")
        unknown = set(self.backends) - set(BACKENDS)
        if unknown:
            raise ValueError(f"unknown backends {sorted(unknown)} (known: {', '.join(BACKENDS)})")

    @property
    def page_bytes(self) -> int:
        return 2 * self.layers * self.page_tokens * self.kv_heads * self.head_dim * 2  # K and V, bf16


def host_pool(config: HiCacheBenchConfig):
    """SGLang's MHA host pool (``page_first``, unpinned) of ``num_pages`` pages."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    page = config.page_tokens
    dev = MHATokenToKVPool(size=4 * page, page_size=page, dtype=torch.bfloat16, head_num=config.kv_heads,
                           head_dim=config.head_dim, layer_num=config.layers, device="cpu",
                           enable_memory_saver=False)
    return MHATokenToKVPoolHost(dev._mha_buffer_info(), 1.0, 0, page, "page_first", pin_memory=False,
                                device="cpu", device_capacity_tokens=4 * page, start_layer=0,
                                end_layer=config.layers, host_token_capacity=(config.num_pages + 1) * page)


def storage_config(config: HiCacheBenchConfig, extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="bench/llama-8b-like", extra_config=extra)


def page_keys(rng: np.random.Generator, config: HiCacheBenchConfig) -> list[str]:
    """SGLang's own page hashes of a random prompt of ``num_pages`` pages."""
    from sglang.srt.mem_cache.utils import get_hash_str

    page = config.page_tokens
    tokens = rng.integers(0, 128_256, config.num_pages * page).tolist()
    keys, prior = [], None
    for i in range(config.num_pages):
        prior = get_hash_str(tokens[i * page:(i + 1) * page], prior)
        keys.append(prior)
    return keys


def page_starts(rng: np.random.Generator, host, num_pages: int) -> list[int]:
    """The first host index of each of ``num_pages`` random pages (not in order)."""
    return [int(p) * host.page_size for p in rng.permutation(host.page_num)[:num_pages]]


def host_indices(starts: list[int], page: int) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([np.arange(s, s + page, dtype=np.int64) for s in starts]))


def _k_v(host) -> tuple[np.ndarray, np.ndarray]:
    """The host pool's K and V blocks as byte arrays ([tokens, bytes of every layer's heads])."""
    buf = host.kv_buffer.view(torch.uint8).numpy()
    return buf[0].reshape(host.size, -1), buf[1].reshape(host.size, -1)


def fill_random(host, starts: list[int], rng: np.random.Generator) -> None:
    page = host.page_size
    for block in _k_v(host):
        for s in starts:
            block[s:s + page] = rng.integers(0, 256, block[s:s + page].shape, dtype=np.uint8)


def clear(host) -> None:
    host.kv_buffer.view(torch.uint8).fill_(0xA5)


def mismatched_pages(src, src_starts: list[int], dst, dst_starts: list[int]) -> int:
    page = src.page_size
    bad = 0
    for a, b in zip(_k_v(src), _k_v(dst), strict=True):
        bad += sum(not np.array_equal(a[s:s + page], b[d:d + page])
                   for s, d in zip(src_starts, dst_starts, strict=True))
    return bad


# --- the two ways SGLang's controller calls a backend -------------------------------------------


def generic_set(backend, host, keys: list[str], starts: list[int]) -> bool:
    """``HiCacheController._generic_page_set``: a flat copy of every page, then ``batch_set``."""
    return bool(backend.batch_set(keys, [host.get_data_page(s) for s in starts]))


def generic_get(backend, host, keys: list[str], starts: list[int]) -> int:
    """``HiCacheController._generic_page_get``: ``batch_get`` into dummy flat
    pages, then each page copied into the host pool; the pages loaded."""
    data = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    if data is None:
        return 0
    loaded = 0
    for s, page in zip(starts, data, strict=True):
        if page is None:
            break
        host.set_from_flat_data_page(s, page)
        loaded += 1
    return loaded


def zero_copy_set(backend, host, keys: list[str], starts: list[int]) -> bool:
    """``HiCacheController._page_set_zero_copy``."""
    return all(backend.batch_set_v1(keys, host_indices(starts, host.page_size)))


def zero_copy_get(backend, host, keys: list[str], starts: list[int]) -> int:
    """``HiCacheController._page_get_zero_copy``: the leading pages loaded."""
    got = backend.batch_get_v1(keys, host_indices(starts, host.page_size))
    return next((i for i, ok in enumerate(got) if not ok), len(got))


# --- one backend, one round ---------------------------------------------------------------------


@dataclass
class Bench:
    config: HiCacheBenchConfig
    src: object
    dst: object
    keys: list[str]
    src_starts: list[int]
    rng: np.random.Generator


def _url(name: str, directory: Path, cluster) -> str:
    if name == "kvferry-file":
        return f"file://{directory}"
    if name == "kvferry-nixl":
        return f"nixl://{directory}?backend=POSIX&xfer_timeout_s=60"
    return f"{cluster.url}&call_timeout_s=60"


def _open(bench: Bench, name: str, directory: Path, cluster, host):
    """Backend ``name`` over ``directory`` (or the Store of ``cluster``), built
    by SGLang's factory as a server builds it, ``host`` registered."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    if name == "sglang-file":
        config = storage_config(bench.config, {"file_storage_path": str(directory)})
        backend = StorageBackendFactory.create_backend("file", config, host)
    else:
        extra = {"backend_name": "kvferry", "module_path": "transfer.adapters.sglang.hicache",
                 "class_name": "KvferryHiCache", "interface_v1": 1,
                 "kvferry_storage_url": _url(name, directory, cluster)}
        backend = StorageBackendFactory.create_backend("dynamic", storage_config(bench.config, extra), host)
    backend.register_mem_pool_host(host)
    return backend


def _close(backend) -> None:
    """kvferry's backend closes its store; SGLang's file backend has nothing to close."""
    close = getattr(backend, "close", None)
    if close is not None:
        close()


def _timed(batches, step) -> tuple[float, list[float]]:
    ms = []
    t0 = time.perf_counter()
    for batch in batches:
        started = time.perf_counter()
        step(*batch)
        ms.append((time.perf_counter() - started) * 1e3)
    return time.perf_counter() - t0, ms


def _batches(keys: list[str], starts: list[int]) -> list[tuple[list[str], list[int]]]:
    return [(keys[b:b + BATCH_PAGES], starts[b:b + BATCH_PAGES]) for b in range(0, len(keys), BATCH_PAGES)]


def run_backend(bench: Bench, name: str, directory: Path, rnd: int) -> list[dict]:
    """Write every page from the first pool; then, through a backend built
    afresh (as a restarted server's), read every page into random pages of
    the second pool, cleared first, and check them byte for byte."""
    config, n = bench.config, bench.config.num_pages
    put, get = (generic_set, generic_get) if name == "sglang-file" else (zero_copy_set, zero_copy_get)
    directory.mkdir()
    cluster = None
    try:
        if name == "kvferry-mooncake":
            from harness.local_mooncake import LocalMooncake

            cluster = LocalMooncake(directory, holder_bytes=(n + 1) * config.page_bytes * 5 // 4 + (64 << 20))
        backend = _open(bench, name, directory, cluster, bench.src)
        try:
            os.sync()  # no dirty pages of an earlier backend throttle this one's writes
            recycle_memory(n * config.page_bytes)
            stored: list[bool] = []
            put_s, put_ms = _timed(_batches(bench.keys, bench.src_starts),
                                   lambda k, s: stored.append(put(backend, bench.src, k, s)))
        finally:
            _close(backend)
        if not all(stored):
            raise RuntimeError(f"{name}: {stored.count(False)} batches were not stored")
        dst_starts = page_starts(bench.rng, bench.dst, n)
        clear(bench.dst)
        backend = _open(bench, name, directory, cluster, bench.dst)
        try:
            loaded: list[int] = []
            get_s, get_ms = _timed(_batches(bench.keys, dst_starts),
                                   lambda k, s: loaded.append(get(backend, bench.dst, k, s)))
        finally:
            _close(backend)
        if sum(loaded) != n:
            raise RuntimeError(f"{name}: {sum(loaded)} of {n} pages loaded")
        bad = mismatched_pages(bench.src, bench.src_starts, bench.dst, dst_starts)
        if bad:
            raise RuntimeError(f"{name}: {bad} K/V blocks of the pages read differ from what was stored")
    finally:
        if cluster is not None:
            cluster.close()
        shutil.rmtree(directory, ignore_errors=True)
    return [_row(name, op, rnd, n, config.page_bytes, s, ms) for op, s, ms in
            (("put", put_s, put_ms), ("get", get_s, get_ms))]


def _row(backend: str, op: str, rnd: int, pages: int, page_bytes: int, seconds: float, ms: list[float]) -> dict:
    return {"backend": backend, "op": op, "round": rnd, "pages": pages, "bytes": pages * page_bytes,
            "gbps": round(pages * page_bytes / seconds / 1e9, 3), "p50_ms": round(percentile(ms, 0.5), 2),
            "max_ms": round(max(ms), 2)}


def memcpy_rows(bench: Bench, rnd: int) -> list[dict]:
    """Every page's K and V blocks, pool to pool, per batch: the machine's limit."""
    dst_starts = page_starts(bench.rng, bench.dst, bench.config.num_pages)
    page = bench.src.page_size
    pairs = list(zip(_k_v(bench.src), _k_v(bench.dst), strict=True))

    def copy(src_starts, dst_starts_):
        for a, b in pairs:
            for s, d in zip(src_starts, dst_starts_, strict=True):
                b[d:d + page] = a[s:s + page]

    n = bench.config.num_pages
    batches = [(bench.src_starts[b:b + BATCH_PAGES], dst_starts[b:b + BATCH_PAGES]) for b in range(0, n, BATCH_PAGES)]
    s, ms = _timed(batches, copy)
    if mismatched_pages(bench.src, bench.src_starts, bench.dst, dst_starts):
        raise RuntimeError("memcpy: the copied pages differ")
    return [_row("memcpy", "copy", rnd, n, bench.config.page_bytes, s, ms)]


def missing_reason(name: str) -> str:
    if name == "kvferry-mooncake":
        from harness.local_mooncake import mooncake_missing_reason

        return mooncake_missing_reason()
    if name == "kvferry-nixl":
        from transfer.storage.nixl.probe import nixl_missing_reason

        return nixl_missing_reason()
    return ""


def run(config: HiCacheBenchConfig) -> tuple[list[dict], dict[str, str]]:
    rng = np.random.default_rng(config.seed)
    src, dst = host_pool(config), host_pool(config)
    clear(dst)  # first touch, before anything is timed
    starts = page_starts(rng, src, config.num_pages)
    fill_random(src, starts, rng)
    bench = Bench(config, src, dst, page_keys(rng, config), starts, rng)
    skipped = {n: r for n in config.backends if (r := missing_reason(n))}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-hicache-") as tmp:
        for rnd in range(1, config.rounds + 1):
            rows += memcpy_rows(bench, rnd)
            ready = [n for n in config.backends if n not in skipped]
            shift = (rnd - 1) % len(ready) if ready else 0
            for name in ready[shift:] + ready[:shift]:  # each round starts with another backend
                print(f"bench-hicache: round {rnd}: {name} ...", flush=True)
                rows += run_backend(bench, name, Path(tmp) / f"{name}-{rnd}", rnd)
    return rows, skipped


def summary(rows: list[dict]) -> list[dict]:
    """Per backend and op: the median over rounds of GB/s, and every round's."""
    out = []
    for key in dict.fromkeys((r["backend"], r["op"]) for r in rows):
        mine = [r for r in rows if (r["backend"], r["op"]) == key]
        out.append({"backend": key[0], "op": key[1], "gbps_median": statistics.median(r["gbps"] for r in mine),
                    "gbps_rounds": [r["gbps"] for r in mine], "p50_ms": statistics.median(r["p50_ms"] for r in mine),
                    "max_ms": max(r["max_ms"] for r in mine)})
    return out


def verdict(summ: list[dict]) -> list[str]:
    """kvferry's file backend against SGLang's, put and get (the issue's target: at least as fast)."""
    by = {(s["backend"], s["op"]): s["gbps_median"] for s in summ}
    lines = []
    for op in ("put", "get"):
        ours, theirs = by.get(("kvferry-file", op)), by.get(("sglang-file", op))
        if ours and theirs:
            lines.append(f"{op}: kvferry-file {ours:.2f} GB/s against sglang-file {theirs:.2f} GB/s "
                         f"({ours / theirs:.2f}x): {'met' if ours >= theirs else 'NOT met'}")
    return lines


def doc_text(config: HiCacheBenchConfig, summ: list[dict], skipped: dict[str, str]) -> str:
    lines = [f"Measured {time.strftime('%Y-%m-%d')}, `make bench-hicache`: SGLang 0.5.23's host pool (MHA "
             f"`page_first`, {config.layers} layers, {config.kv_heads} KV heads of {config.head_dim}, bf16, "
             f"{config.page_tokens}-token pages of {config.page_bytes / (1 << 20):g} MiB), {config.num_pages} pages per "
             f"backend and round, batches of {BATCH_PAGES}, {config.rounds} rounds; every page read compared "
             "byte for byte.", "",
             "| backend | op | GB/s (median) | GB/s per round | p50 / max ms per batch |", "|---|---|---:|---|---|"]
    for s in summ:
        rounds = " / ".join(f"{g:.2f}" for g in s["gbps_rounds"])
        lines.append(f"| {s['backend']} | {s['op']} | {s['gbps_median']:.2f} | {rounds} | "
                     f"{s['p50_ms']:.1f} / {s['max_ms']:.1f} |")
    lines.append("")
    lines += [f"- {v}" for v in verdict(summ)]
    lines += [f"- {name} skipped: {why}" for name, why in skipped.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.hicache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=HiCacheBenchConfig.num_pages)
    ap.add_argument("--layers", type=int, default=HiCacheBenchConfig.layers)
    ap.add_argument("--rounds", type=int, default=HiCacheBenchConfig.rounds)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--json", default="")
    ap.add_argument("--doc", default="", help="a markdown file whose bench-hicache block gets the table")
    args = ap.parse_args(argv)
    config = HiCacheBenchConfig(num_pages=args.pages, layers=args.layers, rounds=args.rounds,
                                backends=tuple(b for b in args.backends.split(",") if b))
    rows, skipped = run(config)
    summ = summary(rows)
    text = doc_text(config, summ, skipped)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config.__dict__ | {"backends": list(config.backends)},
                                               "rows": rows, "summary": summ, "skipped": skipped}, indent=1))
    if args.doc:
        rewrite_block(args.doc, DOC_BLOCK, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
