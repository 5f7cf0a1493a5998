"""A directory of one file per key, as the file and NIXL stores keep it:
where a key's file lives, and the recency index that evicts the least
recently used files beyond a size cap. Not thread-safe: its owner locks.

Layout: ``<root>/<first two characters of the key>/<key>``; temporary files
are dot files in the same directory ending in ``TEMP_SUFFIX``.
"""

from __future__ import annotations

import collections
import os
import time

TEMP_SUFFIX = ".tmp"
# A temporary file this old belongs to a writer that died; a scan deletes it.
STALE_TEMP_S = 600.0


class KeyFiles:
    def __init__(self, root: str, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()  # key -> bytes, oldest first
        self.total_bytes = 0

    def path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key)

    @staticmethod
    def unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def scan(self) -> None:
        """Rebuild the index from the files' mtimes; delete stale temporaries."""
        found, now = [], time.time()
        for sub in os.scandir(self.root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith("."):
                    if entry.name.endswith(TEMP_SUFFIX) and now - st.st_mtime > STALE_TEMP_S:
                        self.unlink(entry.path)
                elif entry.is_file(follow_symlinks=False) and entry.name[:2] == sub.name:
                    found.append((st.st_mtime, entry.name, st.st_size))
        for _, key, nbytes in sorted(found):
            self.total_bytes += nbytes - self._lru.pop(key, 0)
            self._lru[key] = nbytes

    def touch(self, key: str, nbytes: int) -> list[str]:
        """Record a put or hit of ``key``; returns the keys to evict (their
        files are the caller's to delete)."""
        self.total_bytes += nbytes - self._lru.pop(key, 0)
        self._lru[key] = nbytes
        return self.victims(keep=key)

    def victims(self, keep: str | None = None) -> list[str]:
        """Drop the oldest keys until the total is within the cap."""
        out = []
        while self.total_bytes > self.max_bytes and self._lru:
            key = next(iter(self._lru))
            if key == keep:
                break
            self.total_bytes -= self._lru.pop(key)
            out.append(key)
        return out

    def forget(self, key: str) -> None:
        self.total_bytes -= self._lru.pop(key, 0)
