"""The local file store: one file per key under a root directory.

``file:///path/to/dir?max_bytes=200GiB`` (or ``file://relative/dir``). Each
value is ``root/<first two key characters>/<key>``: a 32-byte header (magic,
format version, payload length, CRC-32 of the payload) and the payload, the
concatenation of the key's segments.

- **No Python copy.** Segments are wrapped as memoryviews over their
  addresses (``segment_views``) and written with ``os.pwritev`` / read with
  ``os.preadv``: the kernel copies between the page cache and the pool.
  Segments must therefore be host memory.
- **Atomic.** A put writes a private temporary file next to the target and
  ``os.replace``-s it, so a reader sees the old value or the new one, never a
  mix; concurrent writers of one key leave one of their values.
- **Checked.** A file with a wrong magic or version, or a length that
  disagrees with its size, is a miss, and is deleted; these checks happen
  before anything is read, so a short file leaves the destination untouched.
  The payload's CRC-32 is written with every value and checked on read where
  the value may be torn: nothing is fsync-ed, so only a crash of the machine
  (power, kernel) tears a file, and a file read back in the boot that wrote
  it is what the page cache was given. So the header carries the writer's
  boot (Linux's boot id); a file from another boot or another machine (or
  with no stamp, or where the boot id is not known) has its CRC checked on
  its first read, is stamped with this boot when it matches, and is a miss,
  deleted, when it does not. ``verify=always`` checks every read (a CRC-32
  runs at about 2.5 GB/s a core: slower than the read itself). A mismatch is
  only found after the read.
- **Capped.** ``max_bytes`` bounds the files' total size; the least recently
  used (put or hit) are deleted first. The recency index lives in memory,
  rebuilt at open from the files' mtimes (a hit also bumps the file's mtime).
  Several processes may share a root; each enforces the cap over the files it
  has seen, so the cap is approximate then.

Thread-safe: one object may be shared between threads. Calls are bounded by
the file system's latency (local disks; a hung network mount would hang
them). Nothing is fsync-ed: after a crash a lost or torn file fails its
checks and is a miss.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import struct
import threading
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from transfer.errors import StorageClosedError, StorageError
from transfer.storage.base import (Segment, StorageBackend, StorageURL, check_batch, check_keys, config_from_options,
                                   segment_views)
from transfer.storage.keyfiles import TEMP_SUFFIX, KeyFiles

log = logging.getLogger("kvferry.storage.file")

_MAGIC = b"KVFERRY1"
_FORMAT_VERSION = 1
# magic, format version, reserved, payload bytes, CRC-32 of the payload, the writer's boot (8 bytes,
# zero where not known: files of kvferry before the stamp have zeros there)
_HEADER = struct.Struct("<8sHHQI8s")
_NO_BOOT = bytes(8)
VERIFY_MODES = ("boot", "always")


def boot_stamp() -> bytes:
    """8 bytes naming this boot of this machine (Linux's boot id, which a
    reboot or crash changes and a container shares with its host), or zeros
    where there is none (then every read is checked)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return uuid.UUID(f.read().strip().decode()).bytes[:8]
    except (OSError, ValueError):
        return _NO_BOOT
_IOV_MAX = max(16, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024))
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# a value at least this large has its CRC computed on the store's checksum thread while it is written
_CRC_THREAD_BYTES = 256 << 10


@dataclass(frozen=True, kw_only=True)
class FileStoreConfig:
    """``root``: the directory (created if missing). ``max_bytes``: the cap on
    the files' total size, headers included. ``verify``: ``boot`` checks a
    value's CRC on its first read after a reboot or on another machine (see
    the module docstring), ``always`` on every read (a root on a network file
    system whose server may lose written data: there, take ``always``)."""

    root: str
    max_bytes: int = 64 << 30
    verify: str = "boot"

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("FileStoreConfig.root must not be empty")
        if not isinstance(self.max_bytes, int) or self.max_bytes <= 0:
            raise ValueError(f"FileStoreConfig.max_bytes must be > 0, got {self.max_bytes!r}")
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"FileStoreConfig.verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}")


def _io_all(op, fd: int, views: list, offset: int) -> int:
    """Run ``os.preadv``/``os.pwritev`` until every view is done or a read
    hits the end of the file; returns the bytes moved."""
    views, index, moved = list(views), 0, 0
    while index < len(views):
        n = op(fd, views[index:index + _IOV_MAX], offset)
        if n == 0:
            break
        offset, moved = offset + n, moved + n
        while n and index < len(views):
            if n >= len(views[index]):
                n -= len(views[index])
                index += 1
            else:
                views[index], n = views[index][n:], 0
    return moved


def _crc(views: Sequence[memoryview]) -> int:
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    return crc


class FileStore(StorageBackend):
    """The local file store (see the module docstring). Thread-safe."""

    def __init__(self, config: FileStoreConfig, *, url: str = "") -> None:
        self.config = config
        self.url = url or f"file://{config.root}"
        self._root = os.path.abspath(config.root)
        self._lock = threading.Lock()
        self._closed = False
        self._index = KeyFiles(self._root, config.max_bytes)
        self._path, self._unlink = self._index.path, self._index.unlink
        self._temp_names = itertools.count()
        self._boot = boot_stamp()
        self._checksums: ThreadPoolExecutor | None = None  # started by the first large put
        try:
            os.makedirs(self._root, exist_ok=True)
            self._index.scan()
        except OSError as exc:
            raise StorageError(f"{self.url}: cannot open the store directory: {exc}", backend=self.url) from exc
        self._evict()

    # -- index ------------------------------------------------------------

    def _touch(self, key: str, nbytes: int) -> list[str]:
        """Record a put or hit of ``key``; returns the keys to evict (the
        caller deletes them outside the lock)."""
        with self._lock:
            return self._index.touch(key, nbytes)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._index.forget(key)

    def _evict(self, victims: list[str] | None = None) -> None:
        if victims is None:
            with self._lock:
                victims = self._index.victims()
        for key in victims:
            self._unlink(self._path(key))
        if victims:
            log.debug("%s: evicted %d files", self.url, len(victims))

    # -- files ------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StorageClosedError(f"{self.url}: the store was closed", backend=self.url)

    def _os_error(self, what: str, exc: OSError) -> StorageError:
        return StorageError(f"{self.url}: {what}: {exc}", backend=self.url, code=exc.errno)

    # -- the interface ----------------------------------------------------

    def exists(self, keys: Sequence[str]) -> int:
        self._check_open()
        check_keys(keys)
        for count, key in enumerate(keys):
            try:
                os.stat(self._path(key))
            except FileNotFoundError:
                self._forget(key)
                return count
            except OSError as exc:
                raise self._os_error(f"stat of {key}", exc) from exc
        return len(keys)

    def put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[bool]:
        self._check_open()
        totals = check_batch(keys, segments, unique=True)
        return [self._put_one(key, segs, total) for key, segs, total in zip(keys, segments, totals, strict=True)]

    def _put_one(self, key: str, segments: Sequence[Segment], total: int) -> bool:
        file_bytes = _HEADER.size + total
        if file_bytes > self.config.max_bytes:
            log.debug("%s: %s (%d bytes) is larger than the cap", self.url, key, file_bytes)
            return False
        views = segment_views(segments)
        crc = self._crc_of(views, total)
        path = self._path(key)
        temp = os.path.join(os.path.dirname(path),
                            f".{key[:64]}.{os.getpid()}.{threading.get_ident()}.{next(self._temp_names)}{TEMP_SUFFIX}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                written = _io_all(os.pwritev, fd, views, _HEADER.size)
                header = _HEADER.pack(_MAGIC, _FORMAT_VERSION, 0, total, crc(), self._boot)
                written += os.pwrite(fd, header, 0)
            finally:
                os.close(fd)
            if written != file_bytes:
                raise OSError(errno.EIO, f"short write: {written} of {file_bytes} bytes")
            os.replace(temp, path)
        except OSError as exc:
            self._unlink(temp)
            if exc.errno in _NO_SPACE:
                log.warning("%s: no space for %s: %s", self.url, key, exc)
                return False
            raise self._os_error(f"writing {key}", exc) from exc
        self._evict(self._touch(key, file_bytes))
        return True

    def get_into(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[bool]:
        self._check_open()
        totals = check_batch(keys, segments)
        return [self._get_one(key, segs, total) for key, segs, total in zip(keys, segments, totals, strict=True)]

    def _crc_of(self, views: list[memoryview], total: int) -> Callable[[], int]:
        """The CRC-32 of ``views``: a large value's is computed on the
        store's checksum thread while the caller writes the payload (zlib lets
        the interpreter lock go, so the two overlap on two cores); call the
        result for it."""
        with self._lock:
            if total >= _CRC_THREAD_BYTES and not self._closed:
                if self._checksums is None:
                    self._checksums = ThreadPoolExecutor(1, thread_name_prefix="kvferry-file-crc")
                return self._checksums.submit(_crc, views).result
        crc = _crc(views)
        return lambda: crc

    def _get_one(self, key: str, segments: Sequence[Segment], total: int) -> bool:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(key)
            return False
        except OSError as exc:
            raise self._os_error(f"opening {key}", exc) from exc
        try:
            st = os.fstat(fd)
            header = os.pread(fd, _HEADER.size, 0)
            if len(header) != _HEADER.size:
                return self._corrupt(key, path, st, "shorter than its header")
            magic, version, _, payload_bytes, crc, boot = _HEADER.unpack(header)
            if magic != _MAGIC or version != _FORMAT_VERSION:
                return self._corrupt(key, path, st, "not a kvferry page file of this version")
            if st.st_size != _HEADER.size + payload_bytes:
                return self._corrupt(key, path, st, f"{st.st_size} bytes on disk, header says {payload_bytes}")
            if payload_bytes != total:
                log.debug("%s: %s holds %d bytes, %d expected", self.url, key, payload_bytes, total)
                return False
            views = segment_views(segments)
            if _io_all(os.preadv, fd, views, _HEADER.size) != total:
                return self._corrupt(key, path, st, "shrank while read")
            unproven = boot != self._boot or boot == _NO_BOOT
            if unproven or self.config.verify == "always":
                if _crc(views) != crc:
                    return self._corrupt(key, path, st, "checksum mismatch")
                if unproven and self._boot != _NO_BOOT:
                    self._stamp(path, st, header)
            self._bump_mtime(fd)
        except OSError as exc:
            raise self._os_error(f"reading {key}", exc) from exc
        finally:
            os.close(fd)
        self._evict(self._touch(key, st.st_size))
        return True

    def _stamp(self, path: str, st: os.stat_result, header: bytes) -> None:
        """A value from another boot matched its CRC: stamp it with this boot,
        so that its next reads are not checked again (best effort: another
        user's file in a shared directory may refuse it; a value that replaced
        it meanwhile is left alone)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            if os.fstat(fd).st_ino == st.st_ino:
                os.pwrite(fd, header[:_HEADER.size - 8] + self._boot, 0)
        except OSError:
            pass
        finally:
            os.close(fd)

    @staticmethod
    def _bump_mtime(fd: int) -> None:
        """Persist the hit for the next open's recency order (best effort:
        another user's file in a shared directory may refuse it)."""
        try:
            os.utime(fd)
        except OSError:
            pass

    def _corrupt(self, key: str, path: str, st: os.stat_result, why: str) -> bool:
        log.warning("%s: %s is corrupt (%s); deleted", self.url, key, why)
        try:
            if os.stat(path).st_ino == st.st_ino:  # not a new value that replaced it meanwhile
                self._unlink(path)
        except FileNotFoundError:
            pass
        self._forget(key)
        return False

    def close(self) -> None:
        self._closed = True
        with self._lock:
            checksums, self._checksums = self._checksums, None
        if checksums is not None:
            checksums.shutdown(wait=True)

    @property
    def total_bytes(self) -> int:
        """The files' total size as this object's index counts it."""
        with self._lock:
            return self._index.total_bytes


def open_file_store(url: StorageURL, options: Mapping[str, Any]) -> FileStore:
    """The ``file://`` opener: the URL's location is the root directory."""
    if not url.location:
        raise ValueError(f"{url.url}: a file store needs a directory, e.g. file:///var/cache/kvferry")
    return FileStore(config_from_options(FileStoreConfig, options, url.url, root=url.location), url=url.url)
