"""Mooncake Store: pages in a cluster's pooled memory, through a mooncake_master.

``mooncake://<master host>:<port>?protocol=rdma&device_name=mlx5_0&local_hostname=10.0.0.2``.
The memory is contributed by clients: each ``MooncakeStore`` may add
``global_segment_size`` bytes of its own (0, the default, makes it a pure
consumer), and dedicated holders run ``mooncake_client --host=<ip>
--master_server_address=<master> --global_segment_size=64GB``. The master must
be started bound to an interface (``--rpc_address``, ``--metrics_host``): its
defaults listen on every interface.

Calls used (mooncake-transfer-engine 0.3.13.post1, ``mooncake.store.MooncakeDistributedStore``):

- ``batch_is_exist(keys)`` -> per key 1 / 0 / negative error;
- ``batch_put_from_multi_buffers(keys, ptrs, sizes, config)`` and
  ``batch_get_into_multi_buffers(keys, ptrs, sizes)``: one value spread over
  many buffers, so a page moves straight between the pool's per-layer blocks
  and the Store (zero copy); per key 0 / bytes read, or a negative error;
- ``batch_upsert_from(keys, ptrs, sizes, config)`` to overwrite: a ``put`` of
  an existing key returns 0 but **keeps the old value**, and there is no
  multi-buffer upsert. So a put asks ``batch_is_exist`` first, puts new keys
  zero-copy, and overwrites existing ones through a registered host **bounce
  buffer** (``bounce_bytes``, grown to fit the largest value): their segments
  are gathered into it and upserted. Upsert also works inside the read lease,
  where ``remove`` is refused (-706). A key that appears between the check and
  the put keeps the other writer's value; with page keys that is the same
  bytes;
- ``register_buffer(ptr, size)`` for :meth:`MooncakeStore.register_memory`
  (needed for RDMA; TCP reads and writes unregistered memory too).

A get whose buffers add up to more than the value fails with -800
(TRANSFER_FAIL), to less with -600 (INVALID_PARAMS), both before a byte
moves; a missing key is -704. All three are a ``False``, destination untouched.

Batches are cut to at most ``max_entries_per_call`` buffers per call: the
TCP transport rejects, and may wedge on, more than its per-peer queue holds
(measured: 512 keys x 8 buffers failed after 60 s with the default queue
caps, and the path to that holder stayed broken); kvferry also raises those
caps before the Store's engine is built
(:func:`transfer.transport.mooncake.process.apply_mooncake_env`).

Time bounds (:mod:`~transfer.storage.mooncake.client`): every Store call runs
on one worker thread that alone holds the client, and the caller waits at most
``call_timeout_s`` per API call (``setup_timeout_s``, ``close_timeout_s``),
then raises :class:`~transfer.errors.StorageTimeoutError`; until the stuck call
returns, later calls raise :class:`~transfer.errors.StorageUnavailableError`
at once. RPC failures (-900...) raise StorageUnavailableError.

Logging: the Store reads ``MC_LOG_LEVEL`` when ``mooncake.store`` is first
imported, so it is set (``log_level``, default ERROR) before that import; it
still logs failures (a size mismatch, a failed transfer, an RPC error) at E level.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any
from collections.abc import Mapping, Sequence

from transfer.config import EngineConfig
from transfer.errors import StorageClosedError, StorageError, StorageTimeoutError
from transfer.storage.base import Segment, StorageBackend, StorageURL, check_batch, check_keys, config_from_options
from transfer.storage.mooncake.client import StoreClient, check_master, code_name
from transfer.storage.mooncake.config import MooncakeStoreConfig
from transfer.storage.mooncake.plan import bounce_batches, entry_chunks, pointers_and_sizes
from transfer.transport.mooncake.process import apply_mooncake_env, reserve_fd_table

__all__ = ["MooncakeStore", "open_mooncake_store"]

log = logging.getLogger("kvferry.storage.mooncake")


class MooncakeStore(StorageBackend):
    """A Mooncake Store client (see the module docstring). Callers are
    serialised; each public call is bounded by ``call_timeout_s``."""

    def __init__(self, config: MooncakeStoreConfig, *, url: str = "") -> None:
        self.config = config
        self.url = url or f"mooncake://{config.master_addr}"
        apply_mooncake_env(EngineConfig(log_level=config.log_level, protocol=config.protocol))  # MC_LOG_LEVEL is read on import
        reserve_fd_table()  # its client's transfer engine runs the same I/O thread (docs/reliability.md)
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            raise StorageError(f"{self.url}: the Mooncake Store is not installed: {exc}", backend=self.url) from exc
        self._lock = threading.Lock()
        self._closed = False
        self._registered: dict[int, int] = {}  # address -> bytes
        self._bounce: Any = None
        self._retired: list[Any] = []  # old bounce buffers: a stuck call may still use them
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = config.replica_num
        deadline = time.monotonic() + config.setup_timeout_s
        check_master(config.master_addr, min(2.0, config.setup_timeout_s), self.url)
        self._client = StoreClient(self.url, MooncakeDistributedStore, {
            "local_hostname": config.local_hostname, "metadata_server": config.metadata_server,
            "global_segment_size": config.global_segment_size, "local_buffer_size": config.local_buffer_size,
            "protocol": config.protocol, "rdma_devices": config.device_name, "master_server_addr": config.master_addr,
        }, deadline)

    def _enter(self, what: str) -> float:
        """Take the caller lock; returns the call's deadline."""
        deadline = time.monotonic() + self.config.call_timeout_s
        if self._closed:
            raise StorageClosedError(f"{self.url}: {what} after close()", backend=self.url)
        if not self._lock.acquire(timeout=self.config.call_timeout_s):
            raise StorageTimeoutError(f"{self.url}: {what}: another call held the store too long", backend=self.url)
        try:
            if self._closed:
                raise StorageClosedError(f"{self.url}: {what} after close()", backend=self.url)
            # before anything is staged: a stuck upsert may still read the bounce buffer
            self._client.check_free(what)
        except BaseException:
            self._lock.release()
            raise
        return deadline

    def _present(self, keys: Sequence[str], deadline: float, *, leading: bool) -> list[bool]:
        return self._client.present(keys, deadline, max_keys_per_call=self.config.max_entries_per_call,
                                    leading=leading)

    # -- the interface ----------------------------------------------------

    def exists(self, keys: Sequence[str]) -> int:
        check_keys(keys)
        deadline = self._enter("exists")
        try:
            present = self._present(keys, deadline, leading=True)
        finally:
            self._lock.release()
        return present.index(False) if False in present else len(present)

    def put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[bool]:
        totals = check_batch(keys, segments, unique=True)
        deadline = self._enter("put")
        try:
            results = [False] * len(keys)
            present = self._present(keys, deadline, leading=False)
            new = [i for i in range(len(keys)) if not present[i]]
            for chunk in entry_chunks(new, segments, self.config.max_entries_per_call):
                codes = self._client.call("batch_put_from_multi_buffers", deadline, [keys[i] for i in chunk],
                                          *pointers_and_sizes(chunk, segments), self._replicate)
                self._record("put", chunk, keys, codes, results)
            existing = [i for i in range(len(keys)) if present[i]]
            if existing:
                self._upsert(existing, keys, segments, totals, deadline, results)
            return results
        finally:
            self._lock.release()

    def _record(self, what: str, chunk: list[int], keys: Sequence[str], codes: Sequence[int],
                results: list[bool]) -> None:
        self._client.fail_if_unavailable(what, codes)
        for i, code in zip(chunk, codes, strict=True):
            results[i] = code == 0
            if code != 0:
                log.debug("%s: %s of %s returned %s", self.url, what, keys[i], code_name(code))

    def _upsert(self, indices: list[int], keys, segments, totals: list[int], deadline: float,
                results: list[bool]) -> None:
        """Overwrite existing keys through the bounce buffer (no multi-buffer upsert exists)."""
        base = self._bounce_address(max(totals[i] for i in indices), deadline)
        capacity = ctypes.sizeof(self._bounce)
        for chunk in bounce_batches(indices, totals, capacity, self.config.max_entries_per_call):
            addrs, offset = [], 0
            for j in chunk:
                addrs.append(base + offset)
                for addr, nbytes in segments[j]:
                    ctypes.memmove(base + offset, addr, nbytes)
                    offset += nbytes
            codes = self._client.call("batch_upsert_from", deadline, [keys[j] for j in chunk], addrs,
                                      [totals[j] for j in chunk], self._replicate, keepalive=self._bounce)
            self._record("upsert", chunk, keys, codes, results)

    def _bounce_address(self, min_bytes: int, deadline: float) -> int:
        if self._bounce is None or ctypes.sizeof(self._bounce) < min_bytes:
            size = max(self.config.bounce_bytes, min_bytes)
            bounce = (ctypes.c_char * size)()
            rc = self._client.call("register_buffer", deadline, ctypes.addressof(bounce), size)
            if rc != 0:
                raise StorageError(f"{self.url}: register_buffer of the {size}-byte bounce buffer returned "
                                   f"{code_name(rc)}", backend=self.url, code=rc)
            if self._bounce is not None:
                self._client.call("unregister_buffer", deadline, ctypes.addressof(self._bounce))
                self._retired.append(self._bounce)
            self._bounce = bounce
        return ctypes.addressof(self._bounce)

    def get_into(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[bool]:
        totals = check_batch(keys, segments)
        deadline = self._enter("get_into")
        try:
            results = [False] * len(keys)
            for chunk in entry_chunks(range(len(keys)), segments, self.config.max_entries_per_call):
                codes = self._client.call("batch_get_into_multi_buffers", deadline, [keys[i] for i in chunk],
                                          *pointers_and_sizes(chunk, segments))
                self._client.fail_if_unavailable("get", codes)
                for i, code in zip(chunk, codes, strict=True):
                    results[i] = code == totals[i]
                    if code != totals[i] and code != -704:
                        log.debug("%s: get of %s returned %s", self.url, keys[i], code_name(code))
            return results
        finally:
            self._lock.release()

    def register_memory(self, regions: Sequence[Segment]) -> None:
        deadline = self._enter("register_memory")
        try:
            for addr, nbytes in regions:
                if self._registered.get(addr, 0) >= nbytes:
                    continue
                if addr in self._registered:  # grown: register it again
                    self._client.call("unregister_buffer", deadline, addr)
                    del self._registered[addr]
                rc = self._client.call("register_buffer", deadline, addr, nbytes)
                if rc != 0:
                    raise StorageError(f"{self.url}: register_buffer({addr:#x}, {nbytes}) returned {code_name(rc)}",
                                       backend=self.url, code=rc)
                self._registered[addr] = nbytes
        finally:
            self._lock.release()

    def close(self) -> None:
        """Unregister the memory and close the client, waiting at most
        ``close_timeout_s`` (then the close goes on in the background)."""
        if not self._lock.acquire(timeout=self.config.close_timeout_s):
            log.warning("%s: close: another call held the store too long; closing anyway", self.url)
            locked = False
        else:
            locked = True
        try:
            if self._closed:
                return
            self._closed = True
            self._client.close(self.config.close_timeout_s, self._release_buffers)
        finally:
            if locked:
                self._lock.release()

    def _release_buffers(self) -> list[int]:
        """On the worker, at close: the addresses to unregister (every
        registered region and the bounce buffer); forgets the regions."""
        buffers = list(self._registered)
        if self._bounce is not None:
            buffers.append(ctypes.addressof(self._bounce))
        self._registered.clear()
        return buffers

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every Store call this object started (a timed-out one, a
        background close) has returned within ``timeout_s``. For tests and
        orderly shutdown."""
        return self._client.wait_idle(timeout_s)


def open_mooncake_store(url: StorageURL, options: Mapping[str, Any]) -> MooncakeStore:
    """The ``mooncake://`` opener: the URL's location is the master's ``host:port``."""
    if not url.location or "/" in url.location:
        raise ValueError(f"{url.url}: a Mooncake Store URL is mooncake://<master host>:<port>[?options]")
    return MooncakeStore(config_from_options(MooncakeStoreConfig, options, url.url, master_addr=url.location),
                         url=url.url)
