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
caps before the Store's engine is built (:func:`transfer.config.apply_mooncake_env`).

Time bounds. The Store's calls are synchronous and have their own long
timeouts: ``setup`` against an absent master retries for about 90 s (20 x
4.5 s); with the master dead, ``batch_is_exist`` and gets usually fail (-900)
at once, but puts, upserts and any call that meets the client's reconnect
attempt take about 4.3 s; a stalled transfer waits up to 60 s. Closing takes
about 1 s, and the client's destructor unmounts its memory at the master,
retrying for about 12 s when the master is gone. So every Store call, the
destructor included, runs on one worker thread that alone holds the client,
and the caller waits at most ``call_timeout_s`` per API call
(``setup_timeout_s``, ``close_timeout_s``), then raises
:class:`~transfer.errors.StorageTimeoutError`; until the stuck call returns,
later calls raise :class:`~transfer.errors.StorageUnavailableError` at once
(and the stuck call may still touch its segments). Open first checks that the
master's port accepts a TCP connection. ``health_check()`` is not used: it
reports healthy after the master died; RPC failures (-900...) raise
StorageUnavailableError.

Logging: the Store reads ``MC_LOG_LEVEL`` when ``mooncake.store`` is first
imported, so it is set (``log_level``, default ERROR) before that import; it
still logs failures (a size mismatch, a failed transfer, an RPC error) at E level.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import socket
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from transfer.config import EngineConfig, apply_mooncake_env
from transfer.errors import StorageClosedError, StorageError, StorageTimeoutError, StorageUnavailableError
from transfer.storage.base import Segment, StorageBackend, StorageURL, check_batch, check_keys, config_from_options

log = logging.getLogger("kvferry.storage.mooncake")

# ErrorCode values of mooncake-store (types.h) that appear in results.
_CODE_NAMES = {
    -200: "NO_AVAILABLE_HANDLE (no space)", -600: "INVALID_PARAMS", -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -800: "TRANSFER_FAIL", -900: "RPC_FAIL",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}


def _code_name(code: int) -> str:
    return f"{code} ({_CODE_NAMES[code]})" if code in _CODE_NAMES else str(code)


def _is_unavailable(code: int) -> bool:
    """The master or the cluster cannot serve any key (RPC errors)."""
    return -999 <= code <= -900 or code in (-1010, -1011)


@dataclass(frozen=True, kw_only=True)
class MooncakeStoreConfig:
    """One client of a Mooncake Store cluster.

    ``master_addr`` is the master's ``host:port``. ``metadata_server`` is
    ``P2PHANDSHAKE`` or the master's HTTP metadata URL. ``local_hostname`` is
    the address other clients reach this one at. ``global_segment_size``:
    bytes this client contributes to the pool (0: none); ``local_buffer_size``:
    the Store's own buffer for its bytes API (unused by kvferry's calls but
    required). ``bounce_bytes``: the host buffer that overwrites go through.
    """

    master_addr: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 0
    local_buffer_size: int = 16 << 20
    replica_num: int = 1
    max_entries_per_call: int = 1024
    bounce_bytes: int = 64 << 20
    call_timeout_s: float = 30.0
    setup_timeout_s: float = 10.0
    close_timeout_s: float = 10.0
    log_level: str = "ERROR"

    def __post_init__(self) -> None:
        host, _, port = self.master_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"MooncakeStoreConfig.master_addr must be host:port, got {self.master_addr!r}")
        for name in ("replica_num", "max_entries_per_call", "bounce_bytes", "local_buffer_size",
                     "call_timeout_s", "setup_timeout_s", "close_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MooncakeStoreConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.global_segment_size < 0:
            raise ValueError("MooncakeStoreConfig.global_segment_size must be >= 0")


class _StoreThread:
    """One daemon thread that runs every Store call, so that callers can stop
    waiting for one (the Store's calls release the GIL but cannot be
    interrupted). Not thread-safe: :class:`MooncakeStore` serialises callers."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stuck: Future | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvferry-mooncake-store", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future, _keepalive = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

    def check_free(self, what: str) -> None:
        """StorageUnavailableError while a call that timed out is still running."""
        if self._stuck is not None and not self._stuck.done():
            raise StorageUnavailableError(f"{self._url}: {what}: an earlier Store call is still running past its "
                                          "timeout", backend=self._url)

    def call(self, what: str, deadline: float, fn: Callable, *args, must_run: bool = False,
             keepalive: Any = None):
        """``fn(*args)`` on the worker, waiting until ``deadline`` (monotonic).
        A call that is not ``must_run`` is refused while an earlier one is
        stuck, and dropped if its time ran out before it started.
        ``keepalive`` (memory the call uses) stays referenced until it returns."""
        if not must_run:
            self.check_free(what)
        future: Future = Future()
        self._jobs.put((fn, args, future, keepalive))
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            if must_run or not future.cancel():
                self._stuck = future
            raise StorageTimeoutError(f"{self._url}: {what} did not finish in time", backend=self._url) from None

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every queued call finished within ``timeout_s``."""
        if self._stopped:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        done: Future = Future()
        self._jobs.put((lambda: None, (), done, None))
        try:
            done.result(timeout=timeout_s)
            return True
        except FutureTimeout:
            return False

    def post(self, fn: Callable) -> None:
        """Queue ``fn()`` without waiting for it."""
        self._jobs.put((fn, (), Future(), None))

    def stop(self) -> None:
        """The thread ends after the calls queued so far."""
        self._stopped = True
        self._jobs.put(None)


def _pointers_and_sizes(chunk: Sequence[int], segments: Sequence[Sequence[Segment]]):
    """The multi-buffer calls' per-key lists of addresses and of sizes."""
    return [[a for a, _ in segments[i]] for i in chunk], [[n for _, n in segments[i]] for i in chunk]


def _check_master(addr: str, timeout_s: float, url: str) -> None:
    host, _, port = addr.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise StorageUnavailableError(f"{url}: the Mooncake master at {addr} is unreachable: {exc}",
                                      backend=url) from exc


class MooncakeStore(StorageBackend):
    """A Mooncake Store client (see the module docstring). Callers are
    serialised; each public call is bounded by ``call_timeout_s``."""

    def __init__(self, config: MooncakeStoreConfig, *, url: str = "") -> None:
        self.config = config
        self.url = url or f"mooncake://{config.master_addr}"
        apply_mooncake_env(EngineConfig(log_level=config.log_level))  # MC_LOG_LEVEL is read on import
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
        _check_master(config.master_addr, min(2.0, config.setup_timeout_s), self.url)
        self._store: Any = None  # touched only on the worker thread, see _invoke
        self._worker = _StoreThread(self.url)
        try:
            self._worker.call("setup", deadline, self._setup, MooncakeDistributedStore)
        except BaseException:
            self._worker.post(self._close_store)  # a setup that returns after its timeout is closed there
            self._worker.stop()
            raise

    def _setup(self, store_class) -> None:
        store = store_class()
        cfg = self.config
        rc = store.setup({
            "local_hostname": cfg.local_hostname, "metadata_server": cfg.metadata_server,
            "global_segment_size": cfg.global_segment_size, "local_buffer_size": cfg.local_buffer_size,
            "protocol": cfg.protocol, "rdma_devices": cfg.device_name, "master_server_addr": cfg.master_addr,
        })
        if rc != 0:
            raise StorageUnavailableError(f"{self.url}: MooncakeDistributedStore.setup returned {_code_name(rc)}",
                                          backend=self.url, code=rc)
        self._store = store

    def _invoke(self, method: str, *args):
        if self._store is None:  # closed by another thread meanwhile
            raise StorageClosedError(f"{self.url}: {method} after close()", backend=self.url)
        return getattr(self._store, method)(*args)

    def _call(self, method: str, deadline: float, *args, keepalive: Any = None):
        """``store.<method>(*args)`` on the worker thread, bounded by ``deadline``.
        Only the worker holds the client object, so its slow destructor (it
        unmounts memory at the master) never runs on a caller's thread."""
        return self._worker.call(method, deadline, self._invoke, method, *args, keepalive=keepalive)

    # -- plumbing ---------------------------------------------------------

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
            self._worker.check_free(what)
        except BaseException:
            self._lock.release()
            raise
        return deadline

    def _fail_if_unavailable(self, what: str, codes: Sequence[int]) -> None:
        bad = next((c for c in codes if _is_unavailable(c)), None)
        if bad is not None:
            raise StorageUnavailableError(f"{self.url}: {what} failed with {_code_name(bad)}: the master or "
                                          "cluster is unreachable", backend=self.url, code=bad)

    def _chunks(self, indices: Sequence[int], segments: Sequence[Sequence[Segment]]):
        """Runs of ``indices`` with at most ``max_entries_per_call`` buffers (at least one key)."""
        chunk, entries = [], 0
        for i in indices:
            if chunk and entries + len(segments[i]) > self.config.max_entries_per_call:
                yield chunk
                chunk, entries = [], 0
            chunk.append(i)
            entries += len(segments[i])
        if chunk:
            yield chunk

    def _present(self, keys: Sequence[str], deadline: float, *, leading: bool) -> list[bool]:
        """batch_is_exist per key (``leading``: stop after the first absent one)."""
        present: list[bool] = []
        step = self.config.max_entries_per_call
        for start in range(0, len(keys), step):
            codes = self._call("batch_is_exist", deadline, list(keys[start:start + step]))
            self._fail_if_unavailable("batch_is_exist", codes)
            for code in codes:
                if code < 0:
                    raise StorageError(f"{self.url}: batch_is_exist returned {_code_name(code)}",
                                       backend=self.url, code=code)
                present.append(code == 1)
            if leading and not all(present):
                break
        return present

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
            for chunk in self._chunks(new, segments):
                codes = self._call("batch_put_from_multi_buffers", deadline, [keys[i] for i in chunk],
                                   *_pointers_and_sizes(chunk, segments), self._replicate)
                self._record("put", chunk, keys, codes, results)
            existing = [i for i in range(len(keys)) if present[i]]
            if existing:
                self._upsert(existing, keys, segments, totals, deadline, results)
            return results
        finally:
            self._lock.release()

    def _record(self, what: str, chunk: list[int], keys: Sequence[str], codes: Sequence[int],
                results: list[bool]) -> None:
        self._fail_if_unavailable(what, codes)
        for i, code in zip(chunk, codes):
            results[i] = code == 0
            if code != 0:
                log.debug("%s: %s of %s returned %s", self.url, what, keys[i], _code_name(code))

    def _upsert(self, indices: list[int], keys, segments, totals: list[int], deadline: float,
                results: list[bool]) -> None:
        """Overwrite existing keys through the bounce buffer (no multi-buffer upsert exists)."""
        base = self._bounce_address(max(totals[i] for i in indices), deadline)
        capacity = ctypes.sizeof(self._bounce)
        chunk: list[int] = []
        used = 0
        for i in indices + [-1]:
            if chunk and (i < 0 or used + totals[i] > capacity or len(chunk) >= self.config.max_entries_per_call):
                addrs, offset = [], 0
                for j in chunk:
                    addrs.append(base + offset)
                    for addr, nbytes in segments[j]:
                        ctypes.memmove(base + offset, addr, nbytes)
                        offset += nbytes
                codes = self._call("batch_upsert_from", deadline, [keys[j] for j in chunk], addrs,
                                   [totals[j] for j in chunk], self._replicate, keepalive=self._bounce)
                self._record("upsert", chunk, keys, codes, results)
                chunk, used = [], 0
            if i >= 0:
                chunk.append(i)
                used += totals[i]

    def _bounce_address(self, min_bytes: int, deadline: float) -> int:
        if self._bounce is None or ctypes.sizeof(self._bounce) < min_bytes:
            size = max(self.config.bounce_bytes, min_bytes)
            bounce = (ctypes.c_char * size)()
            rc = self._call("register_buffer", deadline, ctypes.addressof(bounce), size)
            if rc != 0:
                raise StorageError(f"{self.url}: register_buffer of the {size}-byte bounce buffer returned "
                                   f"{_code_name(rc)}", backend=self.url, code=rc)
            if self._bounce is not None:
                self._call("unregister_buffer", deadline, ctypes.addressof(self._bounce))
                self._retired.append(self._bounce)
            self._bounce = bounce
        return ctypes.addressof(self._bounce)

    def get_into(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[bool]:
        totals = check_batch(keys, segments)
        deadline = self._enter("get_into")
        try:
            results = [False] * len(keys)
            for chunk in self._chunks(range(len(keys)), segments):
                codes = self._call("batch_get_into_multi_buffers", deadline, [keys[i] for i in chunk],
                                   *_pointers_and_sizes(chunk, segments))
                self._fail_if_unavailable("get", codes)
                for i, code in zip(chunk, codes):
                    results[i] = code == totals[i]
                    if code != totals[i] and code != -704:
                        log.debug("%s: get of %s returned %s", self.url, keys[i], _code_name(code))
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
                    self._call("unregister_buffer", deadline, addr)
                    del self._registered[addr]
                rc = self._call("register_buffer", deadline, addr, nbytes)
                if rc != 0:
                    raise StorageError(f"{self.url}: register_buffer({addr:#x}, {nbytes}) returned {_code_name(rc)}",
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
            deadline = time.monotonic() + self.config.close_timeout_s
            try:
                self._worker.call("close", deadline, self._close_store, must_run=True)
            except StorageTimeoutError:
                log.warning("%s: close did not finish in %.1f s; it goes on in the background", self.url,
                            self.config.close_timeout_s)
            except Exception:  # close never raises: the client is gone either way
                log.warning("%s: close failed", self.url, exc_info=True)
            finally:
                self._worker.stop()
        finally:
            if locked:
                self._lock.release()

    def _close_store(self) -> None:
        if self._store is None:
            return
        buffers = list(self._registered)
        if self._bounce is not None:
            buffers.append(ctypes.addressof(self._bounce))
        for addr in buffers:
            self._store.unregister_buffer(addr)
        self._registered.clear()
        rc = self._store.close()
        if rc != 0:
            log.warning("%s: MooncakeDistributedStore.close returned %s", self.url, _code_name(rc))
        # The client's destructor unmounts its memory at the master and retries
        # for about 12 s when the master is gone: let it run here, not in the
        # thread that drops the last reference to this object.
        self._store = None

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every Store call this object started (a timed-out one, a
        background close) has returned within ``timeout_s``. For tests and
        orderly shutdown."""
        return self._worker.wait_idle(timeout_s)


def open_mooncake_store(url: StorageURL, options: Mapping[str, Any]) -> MooncakeStore:
    """The ``mooncake://`` opener: the URL's location is the master's ``host:port``."""
    if not url.location or "/" in url.location:
        raise ValueError(f"{url.url}: a Mooncake Store URL is mooncake://<master host>:<port>[?options]")
    return MooncakeStore(config_from_options(MooncakeStoreConfig, options, url.url, master_addr=url.location),
                         url=url.url)
