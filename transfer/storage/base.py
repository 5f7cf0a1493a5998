"""The storage interface: batched put/get of KV pages by key, and backends by URL.

A page value is the concatenation of its *segments*: ``(address, nbytes)``
pairs in memory (for a pool, one block per layer and component; see
:mod:`transfer.storage.segments`). Backends move bytes straight between those
addresses and their medium where they can, without a Python copy.

Backends are chosen by URL with :func:`open_storage`::

    file:///var/cache/kv?max_bytes=200GiB          local files (the embedded default)
    file://kvcache                                 a directory relative to the working directory
    mooncake://10.0.0.5:50051?protocol=rdma&device_name=mlx5_0   Mooncake Store (distributed)

The query holds the backend's options (its config dataclass's fields; sizes
may be written ``64MiB``, ``4GB``...); keyword arguments of
:func:`open_storage` override them. A new backend registers its scheme with
:func:`register_scheme` (or a line in ``_SCHEMES``); its module is imported
only when a URL names it.
"""

from __future__ import annotations

import abc
import ctypes
import dataclasses
import importlib
import re
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import parse_qsl, urlsplit

from transfer.errors import StorageError

Segment = tuple[int, int]
"""``(address, nbytes)`` of one contiguous block of memory."""

_VIEW_OF_MEMORY = ctypes.pythonapi.PyMemoryView_FromMemory
_VIEW_OF_MEMORY.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_VIEW_OF_MEMORY.restype = ctypes.py_object
_PYBUF_WRITE = 0x200


def segment_views(segments: Sequence[Segment]) -> list[memoryview]:
    """A writable bytes view (format ``B``) of each segment's memory, which
    the caller keeps alive while it uses the view. Made without a ctypes
    array type: each new length would make a new type, and a type is freed
    only by a garbage collection (which stops every thread)."""
    return [_VIEW_OF_MEMORY(addr, nbytes, _PYBUF_WRITE) for addr, nbytes in segments]

_KEY_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,199}")


class StorageBackend(abc.ABC):
    """A key-value store of KV pages, batched first.

    Contract, for every backend:

    - **Threads.** One object may be called by one thread at a time (the
      integration calls it from one background thread, never from the
      scheduler's ``poll()``); a backend that is also safe to share says so.
    - **Time.** Every call returns or raises within a bound: local file I/O
      within the disk's own latency; a network backend within its configured
      timeout, after which it raises :class:`~transfer.errors.StorageTimeoutError`.
    - **Per-key results.** A key that is missing, evicted, corrupt or the
      wrong size is a result (``False``, or the end of the ``exists`` run),
      never an exception. Exceptions mean the backend as a whole failed:
      :class:`~transfer.errors.StorageUnavailableError` (unreachable, timed
      out), :class:`~transfer.errors.StorageClosedError` (after ``close()``),
      :class:`~transfer.errors.StorageError` (anything else); malformed
      arguments raise ``ValueError`` before anything is touched.
    - **Memory.** Segments are host memory that stays valid and unmodified
      for the whole call (device memory only where ``check_memory`` accepts
      it: the NIXL store with ``memory=VRAM``). After a timeout a network backend's stuck call may
      still read or write them until it returns; keep such memory alive (pool
      memory lives as long as the process).
    - **Keys** are 1-200 characters of ``[A-Za-z0-9_.-]`` not starting with a
      dot (what :func:`~transfer.storage.keys.page_keys` makes).
    """

    url: str = ""

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are present (stop at the first absent
        one). A hint: a later ``get_into`` may still miss (eviction)."""

    @abc.abstractmethod
    def put(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[bool]:
        """Store ``keys[i]`` = the concatenation of ``segments[i]``; per key,
        ``True`` if stored. A key already present ends with the new value.
        ``False``: not stored (no space, larger than the backend's cap, a
        per-key transfer failure). The same key twice in one call is a
        ``ValueError``. Returns after the source bytes were read."""

    @abc.abstractmethod
    def get_into(self, keys: Sequence[str], segments: Sequence[Sequence[Segment]]) -> list[bool]:
        """Per key, ``True`` if it was found with exactly the total size of
        ``segments[i]`` and its bytes were written into them, in order.
        ``False`` for a missing key or another size leaves the segments
        untouched; ``False`` for a corrupt value or a failed transfer may
        have written part of them."""

    def check_memory(self, device: str) -> None:
        """Raise :class:`~transfer.errors.StorageError` unless this backend
        can read and write segments in memory of ``device`` (``cpu``,
        ``cuda:0``). The storage tier calls it for every pool and the aux
        tensor before any byte moves: a host-memory backend handed a device
        pointer would crash the process (CRC, memmove) or fail every read.
        Default: host memory only."""
        if device != "cpu":
            raise StorageError(f"{self.url or type(self).__name__}: reads and writes host memory only, not "
                               f"{device} memory (CUDA pools: use nixl:// with memory=VRAM and a GDS backend, or "
                               f"no storage_url)", backend=self.url)

    def register_memory(self, regions: Sequence[Segment]) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Announce memory that later segments will lie in (a pool's tensors),
        so a backend that needs registered memory for zero-copy I/O (Mooncake
        over RDMA) registers it once. Others ignore it. Idempotent."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the backend (idempotent, bounded in time). Every later call
        raises :class:`~transfer.errors.StorageClosedError`."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_keys(keys: Sequence[str]) -> None:
    """ValueError unless every key is a valid storage key."""
    for key in keys:
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"invalid storage key {key!r}: 1-200 of [A-Za-z0-9_.-], not starting with '.'")


def check_batch(keys: Sequence[str], segments: Sequence[Sequence[Segment]], *, unique: bool = False) -> list[int]:
    """Validate a put/get batch; returns each key's total bytes.

    ValueError: lengths differ, a bad key, a key without segments, a segment
    that is not ``(address > 0, nbytes > 0)``, or (``unique``) a repeated key.
    """
    if len(keys) != len(segments):
        raise ValueError(f"{len(keys)} keys but {len(segments)} segment lists")
    check_keys(keys)
    if unique and len(set(keys)) != len(keys):
        raise ValueError("the same key appears twice in one put")
    totals = []
    for key, segs in zip(keys, segments, strict=True):
        if not segs:
            raise ValueError(f"key {key!r}: no segments")
        total = 0
        for seg in segs:
            addr, nbytes = seg
            if not (isinstance(addr, int) and isinstance(nbytes, int) and addr > 0 and nbytes > 0):
                raise ValueError(f"key {key!r}: segment {seg!r} must be (address > 0, nbytes > 0) ints")
            total += nbytes
        totals.append(total)
    return totals


_SIZE_RE = re.compile(r"\s*(\d+)\s*([KMGT]?)(i?)B?\s*", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """``4096``, ``"64MiB"``, ``"4 GB"``, ``"512k"`` -> bytes (K/M/G/T are
    powers of 1024 with or without ``i``). ValueError otherwise."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.fullmatch(str(text))
    if not match:
        raise ValueError(f"not a size in bytes: {text!r}")
    return int(match.group(1)) << (10 * " KMGT".index(match.group(2).upper() or " "))


def config_from_options(cls, options: Mapping[str, Any], what: str, **fixed):
    """Build the frozen config dataclass ``cls`` from URL query strings and
    keyword options: each name must be a field; strings are converted by the
    type of the field's default (``*_bytes``/``*_size`` ints accept sizes)."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    kwargs = dict(fixed)
    for name, value in options.items():
        if name not in defaults or name in fixed:
            known = ", ".join(sorted(set(defaults) - set(fixed)))
            raise ValueError(f"{what}: unknown option {name!r} (known: {known})")
        like = defaults[name]
        if isinstance(value, str) and not isinstance(like, str):
            if isinstance(like, bool):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(f"{what}: option {name}={value!r} is not a boolean")
                value = value.lower() in ("1", "true", "yes", "on")
            elif isinstance(like, int):
                value = parse_bytes(value) if name.endswith(("_bytes", "_size")) else int(value)
            elif isinstance(like, float):
                value = float(value)
        kwargs[name] = value
    return cls(**kwargs)


@dataclass(frozen=True)
class StorageURL:
    """A parsed backend URL: ``scheme``, ``location`` (a path for ``file``,
    ``host:port`` for ``mooncake``), and the query's options."""

    url: str
    scheme: str
    location: str
    options: Mapping[str, str]


def parse_url(url: str) -> StorageURL:
    """Split a backend URL; ValueError when it has no scheme or repeats an option."""
    parts = urlsplit(url)
    if not parts.scheme or "://" not in url and parts.scheme != "file":
        raise ValueError(f"storage URL {url!r} needs a scheme, e.g. file:///path or mooncake://host:port")
    pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    options = dict(pairs)
    if len(options) != len(pairs):
        raise ValueError(f"storage URL {url!r} repeats an option")
    return StorageURL(url=url, scheme=parts.scheme.lower(), location=parts.netloc + parts.path, options=options)


Opener = Callable[[StorageURL, Mapping[str, Any]], StorageBackend]

# scheme -> "module:function"; the function takes (StorageURL, options) and
# returns an open backend. Modules are imported on first use.
_SCHEMES: dict[str, str] = {
    "file": "transfer.storage.file:open_file_store",
    "mooncake": "transfer.storage.mooncake.store:open_mooncake_store",
    "nixl": "transfer.storage.nixl.store:open_nixl_store",
}


def register_scheme(scheme: str, opener: str) -> None:
    """Route ``scheme://`` URLs to ``opener`` (``"package.module:function"``)."""
    if ":" not in opener:
        raise ValueError(f"opener must be 'module:function', got {opener!r}")
    _SCHEMES[scheme.lower()] = opener


def open_storage(url: str, **options: Any) -> StorageBackend:
    """Open the backend a URL names; ``options`` override the URL's query.

    ValueError for an unknown scheme or option; the backend's own errors
    (:class:`~transfer.errors.StorageUnavailableError` when a Mooncake master
    cannot be reached...) otherwise.
    """
    parsed = parse_url(url)
    target = _SCHEMES.get(parsed.scheme)
    if target is None:
        raise ValueError(f"no storage backend for {parsed.scheme}:// (known: {', '.join(sorted(_SCHEMES))})")
    module_name, _, function = target.partition(":")
    opener: Opener = getattr(importlib.import_module(module_name), function)
    return opener(parsed, {**parsed.options, **options})
