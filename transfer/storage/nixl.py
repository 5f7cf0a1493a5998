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

**Files.** A 4 KiB header block (magic, format version, flags, payload bytes,
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
overlapping ones are replaced by their union (:func:`plan_registration`).

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
import ctypes
import errno
import itertools
import logging
import mmap
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from transfer.errors import StorageClosedError, StorageError, StorageTimeoutError, StorageUnavailableError
from transfer.storage.base import Segment, StorageBackend, StorageURL, check_batch, check_keys, config_from_options
from transfer.storage.keyfiles import TEMP_SUFFIX, KeyFiles
from transfer.storage.nixl_agent import (RegionSet, _Agent, _import_nixl, _TransferStuck, gds_unavailable_reason,
                                         merge_regions, nixl_missing_reason, plan_registration)

__all__ = ["NixlStore", "NixlStoreConfig", "open_nixl_store", "file_descriptors",
           # from transfer.storage.nixl_agent, named here for the store's callers
           "RegionSet", "gds_unavailable_reason", "merge_regions", "nixl_missing_reason", "plan_registration"]

log = logging.getLogger("kvferry.storage.nixl")

_MAGIC = b"KVFNIXL1"
_FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHHQI")  # magic, format version, flags, payload bytes, CRC-32
_HEADER_BYTES = 4096  # the payload's offset
_FLAG_CRC = 1
_ALIGN = 4096
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True, kw_only=True)
class NixlStoreConfig:
    """``root``: the directory (created if missing). ``backend``: ``POSIX``,
    ``GDS`` or ``GDS_MT``; ``allow_fallback``: POSIX when GDS cannot run.
    ``memory``: ``DRAM`` or ``VRAM`` (GPU ``device_id``), where every segment
    lies. ``max_bytes``: the cap on the files' total size. ``checksum``:
    CRC-32 of host-memory values. ``direct_io``: open files ``O_DIRECT``.
    ``xfer_timeout_s``: the bound on one call's transfers.
    ``max_descs_per_xfer``: descriptors per NIXL transfer (POSIX's I/O pool
    holds 65,536)."""

    root: str
    backend: str = "POSIX"
    allow_fallback: bool = False
    memory: str = "DRAM"
    device_id: int = 0
    max_bytes: int = 64 << 30
    checksum: bool = True
    direct_io: bool = False
    xfer_timeout_s: float = 30.0
    max_descs_per_xfer: int = 16384

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", str(self.backend).upper())
        object.__setattr__(self, "memory", str(self.memory).upper())
        if not self.root:
            raise ValueError("NixlStoreConfig.root must not be empty")
        if self.backend not in ("POSIX", "GDS", "GDS_MT"):
            raise ValueError(f"NixlStoreConfig.backend must be POSIX, GDS or GDS_MT, got {self.backend!r}")
        if self.memory not in ("DRAM", "VRAM"):
            raise ValueError(f"NixlStoreConfig.memory must be DRAM or VRAM, got {self.memory!r}")
        if self.backend == "POSIX" and self.memory == "VRAM":
            raise ValueError("NixlStoreConfig: the POSIX backend cannot reach GPU memory; use backend=GDS")
        for name in ("max_bytes", "xfer_timeout_s", "max_descs_per_xfer"):
            if not getattr(self, name) > 0:
                raise ValueError(f"NixlStoreConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.device_id < 0:
            raise ValueError(f"NixlStoreConfig.device_id must be >= 0, got {self.device_id!r}")


# -- registrations (pure) ---------------------------------------------------


def file_descriptors(fd: int, segments: Sequence[Segment]) -> list[tuple[int, int, int]]:
    """FILE descriptors ``(offset, nbytes, fd)`` placing ``segments`` one after
    another in a file's payload."""
    out, offset = [], _HEADER_BYTES
    for _, nbytes in segments:
        out.append((offset, nbytes, fd))
        offset += nbytes
    return out


def _views(segments: Sequence[Segment]) -> list[memoryview]:
    return [memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B") for addr, nbytes in segments]


def _crc(segments: Sequence[Segment]) -> int:
    crc = 0
    for view in _views(segments):
        crc = zlib.crc32(view, crc)
    return crc


@dataclass
class _Entry:
    """One key of a batch: its file and where its bytes go."""

    index: int
    key: str
    segments: Sequence[Segment]
    total: int
    fd: int = -1
    temp: str = ""
    crc: int | None = None
    stat: os.stat_result | None = None


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
        self._path, self._unlink = self._index.path, self._index.unlink
        self._temp_names = itertools.count()
        self._block = mmap.mmap(-1, _HEADER_BYTES)  # page-aligned: O_DIRECT header I/O
        self._registered = RegionSet()
        try:
            os.makedirs(self._root, exist_ok=True)
            self._index.scan()
        except OSError as exc:
            raise StorageError(f"{self.url}: cannot open the store directory: {exc}", backend=self.url) from exc
        self._agent = _Agent(_import_nixl(), config, self.url)
        self.backend = self._agent.backend  # the NIXL backend in use (POSIX after a fallback)
        self._remove(self._index.victims())

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._index.total_bytes

    # -- the interface ----------------------------------------------------

    def exists(self, keys: Sequence[str]) -> int:
        self._check_open()
        check_keys(keys)
        for count, key in enumerate(keys):
            try:
                if os.stat(self._path(key)).st_size > _HEADER_BYTES:
                    continue
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise self._os_error(f"stat of {key}", exc) from exc
            return count
        return len(keys)

    def put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[bool]:
        self._check_open()
        totals = check_batch(keys, segments, unique=True)
        self._check_direct(segments)
        results = [False] * len(keys)
        entries = []
        for i, (key, segs, total) in enumerate(zip(keys, segments, totals)):
            if _HEADER_BYTES + total <= self.config.max_bytes:
                entries.append(_Entry(i, key, segs, total))
            else:
                log.debug("%s: %s (%d bytes) is larger than the cap", self.url, key, _HEADER_BYTES + total)
        with self._held("put"):
            try:
                entries = [e for e in entries if self._create_temp(e)]
                moved = self._move("WRITE", entries)
                for entry in moved:
                    results[entry.index] = self._publish(entry)
            finally:
                self._close_files(entries, unlink_temps=True)
            victims = [v for e in entries if results[e.index] for v in self._index.touch(e.key, _HEADER_BYTES + e.total)]
        self._remove(victims)
        return results

    def get_into(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[bool]:
        self._check_open()
        totals = check_batch(keys, segments)
        self._check_direct(segments)
        results = [False] * len(keys)
        with self._held("get_into"):
            entries = []
            try:
                for i, (key, segs, total) in enumerate(zip(keys, segments, totals)):
                    entry = _Entry(i, key, segs, total)
                    entries.append(entry)
                    self._open_value(entry)
                for entry in self._move("READ", [e for e in entries if e.fd >= 0]):
                    results[entry.index] = self._verify(entry)
            finally:
                self._close_files(entries, unlink_temps=False)
            victims = [v for e in entries if results[e.index] for v in self._index.touch(e.key, e.stat.st_size)]
        self._remove(victims)
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

    def _move(self, op: str, entries: list[_Entry]) -> list[_Entry]:
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
        except _TransferStuck as exc:
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

    def _chunks(self, entries: list[_Entry]):
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

    def _transfer(self, op: str, chunk: list[_Entry], deadline: float) -> bool:
        device = self._agent.device_id
        memory = [(addr, nbytes, device) for e in chunk for addr, nbytes in e.segments]
        files = [desc for e in chunk for desc in file_descriptors(e.fd, e.segments)]
        if self._agent.move(op, memory, files, deadline):
            return True
        if len(chunk) == 1:
            log.warning("%s: NIXL could not %s %s", self.url, "write" if op == "WRITE" else "read", chunk[0].key)
        return False

    # -- files --------------------------------------------------------------

    @property
    def _open_flags(self) -> int:
        return os.O_CLOEXEC | (os.O_DIRECT if self.config.direct_io else 0)

    def _check_direct(self, segments: Sequence[Sequence[Segment]]) -> None:
        if not self.config.direct_io:
            return
        host = self.config.memory == "DRAM"
        for segs in segments:
            for addr, nbytes in segs:
                if nbytes % _ALIGN or host and addr % _ALIGN:
                    raise ValueError(f"direct_io: segment {(addr, nbytes)} must be {_ALIGN}-byte sized"
                                     + (" and aligned" if host else ""))

    def _create_temp(self, entry: _Entry) -> bool:
        """Open a private temporary file for ``entry``; False when out of space."""
        path = self._path(entry.key)
        entry.temp = os.path.join(os.path.dirname(path), f".{entry.key[:64]}.{os.getpid()}."
                                  f"{threading.get_ident()}.{next(self._temp_names)}{TEMP_SUFFIX}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            entry.fd = os.open(entry.temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | self._open_flags, 0o644)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                log.warning("%s: no space for %s: %s", self.url, entry.key, exc)
                return False
            raise self._os_error(f"creating a file for {entry.key}", exc) from exc
        if self.config.checksum and self.config.memory == "DRAM":
            entry.crc = _crc(entry.segments)
        return True

    def _publish(self, entry: _Entry) -> bool:
        """Write the header of a moved value and rename it into place."""
        flags, crc = (0, 0) if entry.crc is None else (_FLAG_CRC, entry.crc)
        self._block[:] = _HEADER.pack(_MAGIC, _FORMAT_VERSION, flags, entry.total, crc).ljust(_HEADER_BYTES, b"\0")
        try:
            written = os.pwrite(entry.fd, self._block, 0)
            size = os.fstat(entry.fd).st_size
            if written != _HEADER_BYTES or size != _HEADER_BYTES + entry.total:
                log.warning("%s: %s: %d bytes on disk after the write, %d expected", self.url, entry.key, size,
                            _HEADER_BYTES + entry.total)
                return False
            os.replace(entry.temp, self._path(entry.key))
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                log.warning("%s: no space for %s: %s", self.url, entry.key, exc)
                return False
            raise self._os_error(f"writing {entry.key}", exc) from exc
        entry.temp = ""
        return True

    def _open_value(self, entry: _Entry) -> None:
        """Open ``entry``'s file and check its header and size; leaves
        ``entry.fd`` -1 for a miss."""
        try:
            entry.fd = os.open(self._path(entry.key), os.O_RDONLY | self._open_flags)
        except FileNotFoundError:
            self._index.forget(entry.key)
            return
        except OSError as exc:
            raise self._os_error(f"opening {entry.key}", exc) from exc
        try:
            entry.stat = os.fstat(entry.fd)
            if os.preadv(entry.fd, [self._block], 0) < _HEADER.size:
                return self._corrupt(entry, "shorter than its header")
            magic, version, flags, payload_bytes, crc = _HEADER.unpack_from(self._block)
        except OSError as exc:
            raise self._os_error(f"reading {entry.key}", exc) from exc
        if magic != _MAGIC or version != _FORMAT_VERSION:
            return self._corrupt(entry, "not a kvferry NIXL page file of this version")
        if entry.stat.st_size != _HEADER_BYTES + payload_bytes:
            return self._corrupt(entry, f"{entry.stat.st_size} bytes on disk, header says {payload_bytes}")
        if payload_bytes != entry.total:
            log.debug("%s: %s holds %d bytes, %d expected", self.url, entry.key, payload_bytes, entry.total)
            return self._drop(entry)
        verify = flags & _FLAG_CRC and self.config.checksum and self.config.memory == "DRAM"
        entry.crc = crc if verify else None

    def _verify(self, entry: _Entry) -> bool:
        """After a read: the checksum, when there is one; a hit bumps the mtime."""
        if entry.crc is not None and _crc(entry.segments) != entry.crc:
            self._corrupt(entry, "checksum mismatch")
            return False
        try:
            os.utime(entry.fd)  # the next open's recency order; best effort
        except OSError:
            pass
        return True

    def _drop(self, entry: _Entry) -> None:
        if entry.fd >= 0:
            os.close(entry.fd)
            entry.fd = -1

    def _corrupt(self, entry: _Entry, why: str) -> None:
        log.warning("%s: %s is corrupt (%s); deleted", self.url, entry.key, why)
        path = self._path(entry.key)
        try:
            if os.stat(path).st_ino == entry.stat.st_ino:  # not a new value that replaced it meanwhile
                os.unlink(path)
        except FileNotFoundError:
            pass
        self._index.forget(entry.key)
        self._drop(entry)

    def _close_files(self, entries: list[_Entry], *, unlink_temps: bool) -> None:
        for entry in entries:
            if not self._stopped:  # else a cancelled-but-running transfer may still use the fd
                self._drop(entry)
            if unlink_temps and entry.temp:
                self._unlink(entry.temp)

    # -- index ------------------------------------------------------------

    def _remove(self, victims: list[str]) -> None:
        for key in victims:
            self._unlink(self._path(key))
        if victims:
            log.debug("%s: evicted %d files", self.url, len(victims))

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

    def _os_error(self, what: str, exc: OSError) -> StorageError:
        return StorageError(f"{self.url}: {what}: {exc}", backend=self.url, code=exc.errno)


def open_nixl_store(url: StorageURL, options: Mapping[str, Any]) -> NixlStore:
    """The ``nixl://`` opener: the URL's location is the directory."""
    if not url.location:
        raise ValueError(f"{url.url}: a NIXL store needs a directory, e.g. nixl:///mnt/nvme/kvferry?backend=GDS")
    return NixlStore(config_from_options(NixlStoreConfig, options, url.url, root=url.location), url=url.url)
