"""kvferry's storage tier as SGLang's HiCache L3 backend (``HiCacheStorage``).

SGLang loads it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvferry",
        "module_path": "transfer.adapters.sglang.hicache", "class_name": "KvferryHiCache",
        "interface_v1": 1, "kvferry_storage_url": "file:///var/cache/kvferry?max_bytes=200GiB"}'

``kvferry_storage_url`` picks the store (:func:`transfer.storage.open_storage`:
``file://`` by default, ``mooncake://``, ``nixl://``); without it,
``KVFERRY_HICACHE_URL``, else ``file://kvferry-hicache`` in the working
directory. ``interface_v1`` makes SGLang use the zero-copy calls: a page's
bytes move between the store and SGLang's host pool in place (the pool's
``get_page_buffer_meta``: K and V of every layer of a page in a
``page_first`` pool, a (layer, K/V) block each in a ``layer_first`` one;
MLA one latent per page), never through a Python copy.

Keys. SGLang names each page by its hash chain (SHA-256 over the previous
page's digest and the page's tokens, hex). The store's key adds what SGLang's
own file backend adds so that ranks and models never share a value that is
not theirs: the model's name and, for MHA (each TP rank holds its heads), the
rank and TP size; an MLA model's pages are one value for every rank, written
by SGLang's storage writer (TP rank 0) only. A pool other than the KV
(``batch_*_v2``: a speculative draft's KV, SWA, Mamba state) is keyed apart
by its pool name, with the page's own hash.

Draft KV. A draft pool's page is loaded only where its target page loaded in
the same call, and reported missing otherwise (a draft without its target is
never used); ``batch_exists_v2`` counts a prefix only as far as every pool
named has it.

Failures. Every call is bounded by the store's own timeouts; a store that
fails as a whole makes the call's pages missing (False), logged, never an
exception into SGLang's storage threads (and never ``None``, which would stop
them). SGLang calls from a prefetch and a backup thread at once: the store is
used under one lock.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolHitPolicy, PoolTransferResult

from transfer.errors import StorageError
from transfer.storage import open_storage

log = logging.getLogger("kvferry.hicache")

#: Where the store is when SGLang's extra config names none.
DEFAULT_URL = "file://kvferry-hicache"
_NAME_RE = re.compile(r"[^A-Za-z0-9_.-]+")
_KV = "kv"


def key_suffix(model_name: str | None, tp_rank: int, tp_size: int, mla: bool) -> str:
    """What a store key adds to SGLang's page hash: the model (its name made
    a key's characters, shortened by a hash past 48), and for MHA the rank."""
    model = _NAME_RE.sub("-", model_name or "").strip("-.")
    if len(model) > 48:
        model = model[:32] + "-" + hashlib.sha256(model.encode()).hexdigest()[:15]
    return f"_{model}" if mla else f"_{model}_{tp_rank}_{tp_size}"


class KvferryHiCache(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` over a kvferry store (see the module
    docstring). Built by SGLang as ``KvferryHiCache(storage_config, kwargs)``."""

    def __init__(self, storage_config, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.url = extra.get("kvferry_storage_url") or os.environ.get("KVFERRY_HICACHE_URL") or DEFAULT_URL
        self._store = open_storage(self.url)
        self._lock = threading.Lock()
        self.mla = bool(storage_config.is_mla_model)
        self.writer = storage_config.is_storage_writer
        self.suffix = key_suffix(storage_config.model_name, storage_config.tp_rank, storage_config.tp_size, self.mla)
        self.pools: dict[str, Any] = {}
        self.num_loaded = self.num_stored = self.num_failed_calls = 0
        log.info("kvferry HiCache backend: %s (keys ..%s, %s)", self.url, self.suffix,
                 "writes" if self.writer else "reads only: another rank writes an MLA model's pages")

    # --- pools ----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.pools[_KV] = mem_pool_host
        self._check_host_memory(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self.pools[str(host_pool_name)] = host_pool
        self._check_host_memory(host_pool)

    def _check_host_memory(self, pool) -> None:
        device = "cpu"
        buffer = getattr(pool, "kv_buffer", None)
        if buffer is not None and getattr(buffer, "device", None) is not None:
            device = str(buffer.device)
        self._store.check_memory(device)

    # --- keys and segments -----------------------------------------------------

    def store_keys(self, keys, pool: str = _KV) -> list[str]:
        """The store's keys of SGLang's page hashes ``keys`` in ``pool``: the
        hash first (a file store spreads its files by a key's first
        characters), then a pool other than the KV's name, then the suffix."""
        tail = self.suffix if pool == _KV else f".{_NAME_RE.sub('-', pool)}{self.suffix}"
        return [f"{k}{tail}" for k in keys]

    def _segments(self, pool: str, host_indices, num_pages: int) -> list[list[tuple[int, int]]]:
        """Each page's (address, bytes) in the host pool, in the pool's own order."""
        host = self.pools[pool]
        if host_indices is None or host_indices.numel() != num_pages * host.page_size:
            got = 0 if host_indices is None else host_indices.numel()
            raise ValueError(f"pool {pool}: {got} host indices for {num_pages} pages of {host.page_size} tokens")
        ptrs, sizes = host.get_page_buffer_meta(host_indices)
        if not num_pages:
            return []
        per = len(ptrs) // num_pages
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per], strict=True))
                for i in range(num_pages)]

    def _call(self, what: str, n: int, fn) -> list[bool]:
        try:
            with self._lock:
                return list(fn())
        except (StorageError, ValueError, KeyError) as exc:
            self.num_failed_calls += 1
            log.warning("kvferry HiCache %s of %d page(s) at %s failed: %s", what, n, self.url, exc)
            return [False] * n

    # --- zero-copy KV (interface_v1) -------------------------------------------

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        got = self._call("get", len(keys), lambda: self._store.get_into(
            self.store_keys(keys), self._segments(_KV, host_indices, len(keys))))
        self.num_loaded += sum(got)
        return got

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        if not self.writer:
            return [True] * len(keys)  # the writer rank stores this model's shared pages
        put = self._call("put", len(keys), lambda: self._store.put(
            self.store_keys(keys), self._segments(_KV, host_indices, len(keys))))
        self.num_stored += sum(put)
        return put

    def batch_exists(self, keys, extra_info=None) -> int:
        return self._exists(keys, _KV)

    def _exists(self, keys, pool: str) -> int:
        if not keys:
            return 0
        try:
            with self._lock:
                return self._store.exists(self.store_keys(keys, pool))
        except StorageError as exc:
            self.num_failed_calls += 1
            log.warning("kvferry HiCache exists of %d page(s) at %s failed: %s", len(keys), self.url, exc)
            return 0

    # --- pools by name (v2: draft, SWA, state) ------------------------------------

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None) -> PoolTransferResult:
        """The longest prefix of ``keys`` every named pool has as its hit
        policy asks: every page (``all_pages``), or the last pages of the
        prefix (``trailing_pages``: a window's, a state's)."""
        kv = self._exists(keys, _KV)
        hits = {_KV: kv} if kv else {}
        restorable = set(range(1, kv + 1))
        for t in pool_transfers or []:
            name = str(t.name)
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:  # a str Enum: equal to its value too
                upto = self._exists(keys[:kv], name)
                ok = set(range(1, upto + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                tail = max(1, len(t.keys) if t.keys else 1)
                present = self._present(keys[:kv], name)
                ok = {n for n in range(1, kv + 1) if all(present[max(0, n - tail):n])}
                upto = max(ok, default=0)
            else:
                raise ValueError(f"kvferry HiCache: pool {name}: hit policy {t.hit_policy} is not supported")
            if upto:
                hits[name] = upto
            restorable &= ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    def _present(self, keys, pool: str) -> list[bool]:
        """Per key, whether ``pool`` has it (one exists call per key)."""
        return [self._exists([k], pool) == 1 for k in keys]

    def batch_get_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        """Each pool's pages into its host pool; a sidecar pool's page only
        where the KV page of the same key loaded in this call, or, when the
        call asks for no KV (SGLang 0.5.23 reads the KV with ``batch_get_v1``
        and a draft in a call of its own), where the store has the KV page: a
        draft never lands without its target."""
        out: dict[str, list[bool]] = {}
        kv_ok: dict[str, bool] | None = None  # None: no KV asked in this call
        for t in sorted(transfers, key=lambda t: str(t.name) != _KV):
            name, keys = str(t.name), list(t.keys or [])
            try:
                segments = self._segments(name, t.host_indices, len(keys))
            except (ValueError, KeyError) as exc:
                log.warning("kvferry HiCache get of pool %s: %s", name, exc)
                out[name] = [False] * len(keys)
                continue
            if name != _KV and kv_ok is None:
                kv_ok = dict(zip(keys, self._present(keys, _KV), strict=True))
            wanted = [i for i, k in enumerate(keys) if name == _KV or kv_ok.get(k, False)]
            got = self._call("get", len(wanted), lambda n=name, w=wanted, k=keys, g=segments: self._store.get_into(
                self.store_keys([k[i] for i in w], n), [g[i] for i in w]))
            result = [False] * len(keys)
            for i, ok in zip(wanted, got, strict=True):
                result[i] = ok
            if name == _KV:
                kv_ok = dict(zip(keys, result, strict=True))
            out[name] = result
        return out

    def batch_set_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name, keys = str(t.name), list(t.keys or [])
            if not self.writer and name == _KV:
                out[name] = [True] * len(keys)
                continue
            out[name] = self._call("put", len(keys), lambda n=name, k=keys, h=t.host_indices: self._store.put(
                self.store_keys(k, n), self._segments(n, h, len(k))))
        return out

    # --- the copying calls (SGLang's generic path, without interface_v1) ---------

    def get(self, key, target_location=None, target_sizes=None):
        if target_location is None:
            return None
        got = self._call("get", 1, lambda: self._store.get_into(self.store_keys([key]), [_tensor_segment(
            target_location)]))
        return target_location if got[0] else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [self.get(k, t) for k, t in zip(keys, target_locations or [None] * len(keys), strict=True)]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        if not self.writer:
            return True
        if value is None:
            return False
        value = value.contiguous()
        return self._call("put", 1, lambda: self._store.put(self.store_keys([key]), [_tensor_segment(value)]))[0]

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return all(self.set(k, v) for k, v in zip(keys, values or [None] * len(keys), strict=True))

    def exists(self, key) -> bool:
        return self._exists([key], _KV) == 1

    # --- the rest ---------------------------------------------------------------

    def clear(self) -> None:
        """SGLang's "clear the cache": kvferry's stores keep their pages (a
        store may be shared by other servers); logged."""
        log.info("kvferry HiCache: clear() leaves the pages of %s in place", self.url)

    def get_stats(self):
        """None: SGLang then reports its own prefetch and backup counts
        (this backend's are ``num_loaded``, ``num_stored`` and
        ``num_failed_calls``). Never raises: SGLang calls it on the
        scheduler's thread."""
        return None

    def close(self) -> None:
        with self._lock:
            self._store.close()


def _tensor_segment(tensor) -> list[tuple[int, int]]:
    return [(tensor.data_ptr(), tensor.numel() * tensor.element_size())]
