"""GPU-direct storage through NIXL: pages straight between the pool and files.

``nixl:///path/to/dir?backend=GDS&allow_fallback=1&max_bytes=200GiB`` (or
``nixl://relative/dir``). One file per key, ``root/<first two key
characters>/<key>``, moved by a NIXL agent's storage backend:

- ``GDS``, ``GDS_MT`` (GPUDirect Storage through cuFile; ``GDS_MT`` runs it on
  a thread pool): the pool may be GPU memory (``memory=VRAM``,
  ``device_id``), moved between HBM and the disk without a host copy;
- ``POSIX`` (the kernel's file I/O): host memory only (``memory=DRAM``).

**Selection.** GDS asked for where it cannot run (no NVIDIA driver, no CUDA
device, no cuFile, a NIXL build without the plugin) raises
:class:`~transfer.errors.StorageUnavailableError` naming why; with
``allow_fallback=1`` the store uses POSIX instead and logs a warning naming
why (host memory only: a VRAM pool has no fallback).

**Files** (:mod:`~transfer.storage.nixl.files`). A 4 KiB header block (magic, format version, flags, payload bytes,
CRC-32 of the payload when flagged), then the payload, the key's segments
concatenated, 4 KiB aligned as cuFile and ``direct_io=1`` (``O_DIRECT``; every
segment then a multiple of 4 KiB, host segments 4 KiB aligned) want. The
directory is the store's own: the file store's files are foreign here.

**Batches.** A put creates a temporary file per key, registers the files with
the agent and issues *one* NIXL WRITE pairing every segment (DRAM or VRAM
descriptor) with its place in its file (FILE descriptor: offset, bytes, fd),
then writes the headers and ``os.replace``-s the files into place: a reader
sees the old value or the new one. A get first checks each file's header and
size (missing, short, foreign or another size: a miss, the destination
untouched), then issues one READ for the rest. Batches over
``max_descs_per_xfer`` descriptors go as several transfers; a failed transfer
is retried key by key, so a bad file costs only its key.

**Registration.** :meth:`NixlStore.register_memory` registers pool memory with
the agent once; segments outside it are registered for one call. NIXL refuses
a descriptor that is not inside one registered region and mis-resolves
overlapping registrations, so the store keeps its registrations disjoint:
overlapping ones are replaced by their union
(:func:`~transfer.storage.nixl.regions.plan_registration`; NIXL's agent is
wrapped in :mod:`~transfer.storage.nixl.agent`, backend selection in
:mod:`~transfer.storage.nixl.probe`).

**Checks.** With ``checksum`` (default) and host memory, the header holds the
payload's CRC-32, computed by the CPU from the pool; a mismatch on a get is a
corrupt file: a miss, deleted. Device memory is checked by sizes only.
**Cap:** ``max_bytes`` over the files, least recently used deleted first.

**Time.** The transfers of one call are polled against one deadline
(``xfer_timeout_s``); past it the transfer is released (NIXL cancels it) and
:class:`~transfer.errors.StorageTimeoutError` raised. Should NIXL fail to
cancel it, the store stops (later calls raise StorageUnavailableError: the
transfer may still touch its segments and files). Posting a transfer and the
file system calls are bounded by the disk's latency, as in the file store
(POSIX posts buffered I/O mostly synchronously: measured here, 0.8 s to post
256 MiB into new files). Thread-safe: calls are serialised by a lock, waited
for at most ``2 * xfer_timeout_s`` (the agent runs without NIXL's locking).

NIXL calls (nixl 1.5, ``nixl._api.nixl_agent``): ``nixl_agent(name,
nixl_agent_config(backends=[], enable_prog_thread=False))``,
``get_plugin_list``, ``create_backend``, ``get_backend_mem_types``;
``get_reg_descs`` + ``register_memory`` / ``deregister_memory`` (DRAM/VRAM
``(addr, bytes, device, "")``; FILE ``(0, 0, fd, "")``, length 0 being the
whole file); ``get_xfer_descs`` of Nx3 arrays; ``initialize_xfer("WRITE" |
"READ", memory, files, own agent name)``, ``transfer``, ``check_xfer_state``,
``release_xfer_handle``. Importing this module does not import NIXL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any
from collections.abc import Mapping, Sequence

from transfer.errors import StorageClosedError, StorageError, StorageTimeoutError, StorageUnavailableError
from transfer.storage.base import Segment, StorageBackend, StorageURL, check_batch, check_keys, config_from_options
from transfer.storage.keyfiles import KeyFiles
from transfer.storage.nixl.agent import NixlAgent, TransferStuckError
from transfer.storage.nixl.config import NixlStoreConfig
from transfer.storage.nixl.files import HEADER_BYTES, PageEntry, PageFiles, file_descriptors, os_error
from transfer.storage.nixl.probe import import_nixl
from transfer.storage.nixl.regions import RegionSet, plan_registration

__all__ = ["NixlStore", "open_nixl_store"]

log = logging.getLogger("kvferry.storage.nixl")


class NixlStore(StorageBackend):
    """The NIXL file store (see the module docstring). Thread-safe."""

    def __init__(self, config: NixlStoreConfig, *, url: str = "") -> None:
        self.config = config
        self.url = url or f"nixl://{config.root}"
        self._root = os.path.abspath(config.root)
        self._lock = threading.Lock()
        self._closed = False
        self._stopped = ""  # why, after a transfer that could not be cancelled
        self._index = KeyFiles(self._root, config.max_bytes)
        self._path = self._index.path
        self._files = PageFiles(config, self.url, self._index)
        self._registered = RegionSet()
        try:
            os.makedirs(self._root, exist_ok=True)
            self._index.scan()
        except OSError as exc:
            raise StorageError(f"{self.url}: cannot open the store directory: {exc}", backend=self.url) from exc
        self._agent = NixlAgent(import_nixl(), config, self.url)
        self.backend = self._agent.backend  # the NIXL backend in use (POSIX after a fallback)
        self._files.remove(self._index.victims())

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._index.total_bytes

    def check_memory(self, device: str) -> None:
        """``memory=DRAM`` serves the CPU only; ``memory=VRAM`` serves
        ``cuda:<device_id>`` only (a pool on another GPU would be read from
        the wrong device)."""
        cfg = self.config
        want = "cpu" if cfg.memory == "DRAM" else f"cuda:{cfg.device_id}"
        if device == want or (cfg.memory == "VRAM" and device == "cuda" and cfg.device_id == 0):
            return
        raise StorageError(f"{self.url}: memory={cfg.memory}" + (f" device_id={cfg.device_id}" if
                           cfg.memory == "VRAM" else "") + f" serves {want} memory, not {device} memory "
                           f"(CUDA pools need memory=VRAM&device_id=<the pool's GPU> and backend=GDS)",
                           backend=self.url)

    # -- the interface ----------------------------------------------------

    def exists(self, keys: Sequence[str]) -> int:
        self._check_open()
        check_keys(keys)
        for count, key in enumerate(keys):
            try:
                if os.stat(self._path(key)).st_size > HEADER_BYTES:
                    continue
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise os_error(self.url, f"stat of {key}", exc) from exc
            return count
        return len(keys)

    def put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[bool]:
        self._check_open()
        totals = check_batch(keys, segments, unique=True)
        self._files.check_direct(segments)
        results = [False] * len(keys)
        entries = []
        for i, (key, segs, total) in enumerate(zip(keys, segments, totals, strict=True)):
            if HEADER_BYTES + total <= self.config.max_bytes:
                entries.append(PageEntry(i, key, segs, total))
            else:
                log.debug("%s: %s (%d bytes) is larger than the cap", self.url, key, HEADER_BYTES + total)
        with self._held("put"):
            try:
                entries = [e for e in entries if self._files.create_temp(e)]
                moved = self._move("WRITE", entries)
                for entry in moved:
                    results[entry.index] = self._files.publish(entry)
            finally:
                self._files.close_files(entries, unlink_temps=True, keep_fds=bool(self._stopped))
            victims = [v for e in entries if results[e.index] for v in self._index.touch(e.key, HEADER_BYTES + e.total)]
        self._files.remove(victims)
        return results

    def get_into(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[bool]:
        self._check_open()
        totals = check_batch(keys, segments)
        self._files.check_direct(segments)
        results = [False] * len(keys)
        with self._held("get_into"):
            entries = []
            try:
                for i, (key, segs, total) in enumerate(zip(keys, segments, totals, strict=True)):
                    entry = PageEntry(i, key, segs, total)
                    entries.append(entry)
                    self._open_value(entry)
                for entry in self._move("READ", [e for e in entries if e.fd >= 0]):
                    results[entry.index] = self._files.verify(entry)
            finally:
                self._files.close_files(entries, unlink_temps=False, keep_fds=bool(self._stopped))
            victims = [v for e in entries if results[e.index] for v in self._index.touch(e.key, e.stat.st_size)]
        self._files.remove(victims)
        return results

    def register_memory(self, regions: Sequence[Segment]) -> None:
        self._check_open()
        for addr, nbytes in regions:
            if not (isinstance(addr, int) and isinstance(nbytes, int) and addr > 0 and nbytes > 0):
                raise ValueError(f"region {(addr, nbytes)!r} must be (address > 0, nbytes > 0) ints")
        with self._held("register_memory"):
            lift, add = plan_registration(self._registered, regions)
            self._agent.deregister(regions=lift)
            for region in lift:
                self._registered.remove(region)
            self._agent.register(regions=add)
            for region in add:
                self._registered.add(region)

    def close(self) -> None:
        with self._held("close", check_open=False):
            if self._closed:
                return
            self._closed = True
            if not self._stopped:  # else a transfer may still use the registrations: leave them
                try:
                    self._agent.deregister(regions=list(self._registered))
                except StorageError as exc:
                    log.warning("%s: %s", self.url, exc)
                self._agent = None

    # -- transfers ----------------------------------------------------------

    def _move(self, op: str, entries: list[PageEntry]) -> list[PageEntry]:
        """Move every entry's segments to (``WRITE``) or from (``READ``) its
        open file; returns the entries that moved. Registers what the call
        needs beyond the persistent registrations, and undoes that after."""
        if not entries:
            return []
        deadline = time.monotonic() + self.config.xfer_timeout_s
        fds = [e.fd for e in entries]
        lift, temporary = plan_registration(self._registered, (s for e in entries for s in e.segments))
        self._agent.deregister(regions=lift)
        done: list[str] = []
        try:
            self._agent.register(regions=temporary)
            done.append("memory")
            self._agent.register(files=fds)
            done.append("files")
            moved = []
            for chunk in self._chunks(entries):
                if self._transfer(op, chunk, deadline):
                    moved += chunk
                elif len(chunk) > 1:
                    log.warning("%s: a NIXL %s of %d keys failed; retrying key by key", self.url, op, len(chunk))
                    moved += [e for e in chunk if self._transfer(op, [e], deadline)]
            return moved
        except TransferStuckError as exc:
            self._stopped = str(exc)
            raise
        finally:
            if not self._stopped:
                self._unregister(lift, temporary if "memory" in done else [], fds if "files" in done else [])

    def _unregister(self, lift: list[Segment], temporary: list[Segment], fds: list[int]) -> None:
        """Undo one call's registrations (best effort: a failure is logged, and
        lifted regions that cannot be restored are registered per call later)."""
        for what, kwargs in (("files", {"files": fds}), ("memory", {"regions": temporary})):
            try:
                self._agent.deregister(**kwargs)
            except StorageError as exc:
                log.warning("%s: releasing this call's %s: %s", self.url, what, exc)
        try:
            self._agent.register(regions=lift)
        except StorageError as exc:
            log.warning("%s: %s; those regions are registered per call from now on", self.url, exc)
            for region in lift:
                self._registered.remove(region)

    def _chunks(self, entries: list[PageEntry]):
        """Runs of entries with at most ``max_descs_per_xfer`` segments (at least one entry)."""
        chunk, count = [], 0
        for entry in entries:
            if chunk and count + len(entry.segments) > self.config.max_descs_per_xfer:
                yield chunk
                chunk, count = [], 0
            chunk.append(entry)
            count += len(entry.segments)
        if chunk:
            yield chunk

    def _transfer(self, op: str, chunk: list[PageEntry], deadline: float) -> bool:
        device = self._agent.device_id
        memory = [(addr, nbytes, device) for e in chunk for addr, nbytes in e.segments]
        files = [desc for e in chunk for desc in file_descriptors(e.fd, e.segments)]
        if self._agent.move(op, memory, files, deadline):
            return True
        if len(chunk) == 1:
            log.warning("%s: NIXL could not %s %s", self.url, "write" if op == "WRITE" else "read", chunk[0].key)
        return False

    def _open_value(self, entry: PageEntry) -> None:
        """Open ``entry``'s file and check it (:meth:`PageFiles.open_value`)."""
        self._files.open_value(entry)

    # -- plumbing -----------------------------------------------------------

    @contextlib.contextmanager
    def _held(self, what: str, *, check_open: bool = True):
        """The store's lock, waited for at most twice the transfer bound."""
        if not self._lock.acquire(timeout=2 * self.config.xfer_timeout_s):
            raise StorageTimeoutError(f"{self.url}: {what}: another call held the store too long", backend=self.url)
        try:
            if check_open:
                self._check_open()
            yield
        finally:
            self._lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise StorageClosedError(f"{self.url}: the store was closed", backend=self.url)
        if self._stopped:
            raise StorageUnavailableError(self._stopped, backend=self.url)


def open_nixl_store(url: StorageURL, options: Mapping[str, Any]) -> NixlStore:
    """The ``nixl://`` opener: the URL's location is the directory."""
    if not url.location:
        raise ValueError(f"{url.url}: a NIXL store needs a directory, e.g. nixl:///mnt/nvme/kvferry?backend=GDS")
    return NixlStore(config_from_options(NixlStoreConfig, options, url.url, root=url.location), url=url.url)
