"""The ``nixl://`` store's page files: their format and the file system calls
around a NIXL transfer (:mod:`~transfer.storage.nixl.store` moves the payloads).

A file is a 4 KiB header block (magic, format version, flags, payload bytes,
CRC-32 of the payload when flagged), then the payload: the key's segments
concatenated. A put writes into a private temporary file, then the header, then
``os.replace``-s it into place; a get opens the file and checks its header and
size before NIXL reads it (missing, short, foreign or another size: a miss).
Importing this module does not import NIXL."""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from collections.abc import Sequence

from transfer.errors import StorageError
from transfer.storage.base import Segment, segment_views
from transfer.storage.keyfiles import TEMP_SUFFIX, KeyFiles
from transfer.storage.nixl.config import NixlStoreConfig

__all__ = ["HEADER_BYTES", "PageEntry", "PageFiles", "file_descriptors"]

log = logging.getLogger("kvferry.storage.nixl")

_MAGIC = b"KVFNIXL1"
_FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHHQI")  # magic, format version, flags, payload bytes, CRC-32
#: Bytes of a file's header block: the payload starts here.
HEADER_BYTES = 4096
_FLAG_CRC = 1
_ALIGN = 4096
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def file_descriptors(fd: int, segments: Sequence[Segment]) -> list[tuple[int, int, int]]:
    """FILE descriptors ``(offset, nbytes, fd)`` placing ``segments`` one after
    another in a file's payload."""
    out, offset = [], HEADER_BYTES
    for _, nbytes in segments:
        out.append((offset, nbytes, fd))
        offset += nbytes
    return out


def _crc(segments: Sequence[Segment]) -> int:
    crc = 0
    for view in segment_views(segments):
        crc = zlib.crc32(view, crc)
    return crc


def os_error(url: str, what: str, exc: OSError) -> StorageError:
    """An OS error of the store at ``url`` as kvferry's StorageError."""
    return StorageError(f"{url}: {what}: {exc}", backend=url, code=exc.errno)


@dataclass
class PageEntry:
    """One key of a batch: its file and where its bytes go. ``index``: the
    key's place in the call's batch; ``total``: its payload bytes; ``fd``:
    its open file (-1: none, a miss on a get); ``temp``: the temporary file
    a put writes before the rename; ``crc``: the payload's checksum, when
    one is written or checked; ``stat``: the file's, after a get opened it."""

    index: int
    key: str
    segments: Sequence[Segment]
    total: int
    fd: int = -1
    temp: str = ""
    crc: int | None = None
    stat: os.stat_result | None = None


class PageFiles:
    """The store's directory of page files, indexed by ``index``. Not
    thread-safe: the store's lock serialises its callers. OS errors other than
    out-of-space raise StorageError; out of space and bad files are misses."""

    def __init__(self, config: NixlStoreConfig, url: str, index: KeyFiles) -> None:
        self.config = config
        self.url = url
        self.index = index
        self.path, self.unlink = index.path, index.unlink
        self._temp_names = itertools.count()
        self._block = mmap.mmap(-1, HEADER_BYTES)  # page-aligned: O_DIRECT header I/O

    @property
    def _open_flags(self) -> int:
        return os.O_CLOEXEC | (os.O_DIRECT if self.config.direct_io else 0)

    def check_direct(self, segments: Sequence[Sequence[Segment]]) -> None:
        """ValueError when ``direct_io`` is on and a segment is not 4 KiB sized
        (and, in host memory, aligned)."""
        if not self.config.direct_io:
            return
        host = self.config.memory == "DRAM"
        for segs in segments:
            for addr, nbytes in segs:
                if nbytes % _ALIGN or host and addr % _ALIGN:
                    raise ValueError(f"direct_io: segment {(addr, nbytes)} must be {_ALIGN}-byte sized"
                                     + (" and aligned" if host else ""))

    def create_temp(self, entry: PageEntry) -> bool:
        """Open a private temporary file for ``entry``; False when out of space."""
        path = self.path(entry.key)
        entry.temp = os.path.join(os.path.dirname(path), f".{entry.key[:64]}.{os.getpid()}."
                                  f"{threading.get_ident()}.{next(self._temp_names)}{TEMP_SUFFIX}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            entry.fd = os.open(entry.temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | self._open_flags, 0o644)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                log.warning("%s: no space for %s: %s", self.url, entry.key, exc)
                return False
            raise os_error(self.url, f"creating a file for {entry.key}", exc) from exc
        if self.config.checksum and self.config.memory == "DRAM":
            entry.crc = _crc(entry.segments)
        return True

    def publish(self, entry: PageEntry) -> bool:
        """Write the header of a moved value and rename it into place."""
        flags, crc = (0, 0) if entry.crc is None else (_FLAG_CRC, entry.crc)
        self._block[:] = _HEADER.pack(_MAGIC, _FORMAT_VERSION, flags, entry.total, crc).ljust(HEADER_BYTES, b"\0")
        try:
            written = os.pwrite(entry.fd, self._block, 0)
            size = os.fstat(entry.fd).st_size
            if written != HEADER_BYTES or size != HEADER_BYTES + entry.total:
                log.warning("%s: %s: %d bytes on disk after the write, %d expected", self.url, entry.key, size,
                            HEADER_BYTES + entry.total)
                return False
            os.replace(entry.temp, self.path(entry.key))
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                log.warning("%s: no space for %s: %s", self.url, entry.key, exc)
                return False
            raise os_error(self.url, f"writing {entry.key}", exc) from exc
        entry.temp = ""
        return True

    def open_value(self, entry: PageEntry) -> None:
        """Open ``entry``'s file and check its header and size; leaves
        ``entry.fd`` -1 for a miss."""
        try:
            entry.fd = os.open(self.path(entry.key), os.O_RDONLY | self._open_flags)
        except FileNotFoundError:
            self.index.forget(entry.key)
            return
        except OSError as exc:
            raise os_error(self.url, f"opening {entry.key}", exc) from exc
        try:
            entry.stat = os.fstat(entry.fd)
            if os.preadv(entry.fd, [self._block], 0) < _HEADER.size:
                return self.corrupt(entry, "shorter than its header")
            magic, version, flags, payload_bytes, crc = _HEADER.unpack_from(self._block)
        except OSError as exc:
            raise os_error(self.url, f"reading {entry.key}", exc) from exc
        if magic != _MAGIC or version != _FORMAT_VERSION:
            return self.corrupt(entry, "not a kvferry NIXL page file of this version")
        if entry.stat.st_size != HEADER_BYTES + payload_bytes:
            return self.corrupt(entry, f"{entry.stat.st_size} bytes on disk, header says {payload_bytes}")
        if payload_bytes != entry.total:
            log.debug("%s: %s holds %d bytes, %d expected", self.url, entry.key, payload_bytes, entry.total)
            return self.drop(entry)
        verify = flags & _FLAG_CRC and self.config.checksum and self.config.memory == "DRAM"
        entry.crc = crc if verify else None

    def verify(self, entry: PageEntry) -> bool:
        """After a read: the checksum, when there is one; a hit bumps the mtime."""
        if entry.crc is not None and _crc(entry.segments) != entry.crc:
            self.corrupt(entry, "checksum mismatch")
            return False
        try:
            os.utime(entry.fd)  # the next open's recency order; best effort
        except OSError:
            pass
        return True

    def drop(self, entry: PageEntry) -> None:
        """Close ``entry``'s file, if open."""
        if entry.fd >= 0:
            os.close(entry.fd)
            entry.fd = -1

    def corrupt(self, entry: PageEntry, why: str) -> None:
        """Delete a bad file (unless a new value replaced it meanwhile): a miss."""
        log.warning("%s: %s is corrupt (%s); deleted", self.url, entry.key, why)
        path = self.path(entry.key)
        try:
            if os.stat(path).st_ino == entry.stat.st_ino:  # not a new value that replaced it meanwhile
                os.unlink(path)
        except FileNotFoundError:
            pass
        self.index.forget(entry.key)
        self.drop(entry)

    def close_files(self, entries: list[PageEntry], *, unlink_temps: bool, keep_fds: bool) -> None:
        """After a call: close the files (unless ``keep_fds``: a cancelled but
        running transfer may still use them) and delete leftover temporaries."""
        for entry in entries:
            if not keep_fds:
                self.drop(entry)
            if unlink_temps and entry.temp:
                self.unlink(entry.temp)

    def remove(self, victims: list[str]) -> None:
        """Delete the files of evicted keys."""
        for key in victims:
            self.unlink(self.path(key))
        if victims:
            log.debug("%s: evicted %d files", self.url, len(victims))
