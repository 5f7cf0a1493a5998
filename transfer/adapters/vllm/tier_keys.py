"""The kvferry tier's options and the store keys of vLLM's offloaded chunks. Pure.

vLLM names an offloaded chunk by its ``OffloadKey``: the block hash of the
chunk's last block and the KV-cache group's index. The hash names the
tokens (and everything before them), not the bytes: two models, dtypes,
block sizes or parallel layouts give the same tokens different KV. So a
store key binds the hash to a *namespace*, a digest of what makes two
servers' chunk bytes the same. vLLM's own file tier names its directory by
the same fields (``FileMapper.get_run_config()``: model, dtype, tokens per
hash, blocks per chunk, the parallel sizes and rank, each group's block size
and layer names, the canonical layout's format); the namespace adds the
chunk's size in the primary CPU tier (all workers' bytes of one chunk, with
its padding) and :data:`TIER_KEY_VERSION`:

    key = "<block hash, hex>.g<group>.<namespace: 16 hex digits>"

The hash comes first: the file store spreads its files over directories by
a key's first two characters. Changing how keys are derived changes every
key: bump :data:`TIER_KEY_VERSION`, which makes old entries unreachable
instead of misread.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

TIER_KEY_VERSION = 1

#: Where the store is when the tier's config names none: a directory in the server's working directory.
DEFAULT_URL = "file://kvferry-vllm-tier"

_NAMESPACE_HEX = 16


def namespace_of(layout: Mapping[str, Any], chunk_bytes: int) -> str:
    """16 hex digits naming ``layout`` (vLLM's run config of the offloaded
    KV, a JSON-able mapping) and the chunk's size in bytes."""
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
    text = json.dumps({"tier_key_version": TIER_KEY_VERSION, "chunk_bytes": chunk_bytes, "layout": layout},
                      sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:_NAMESPACE_HEX]


def store_key(namespace: str, block_hash: bytes, group_idx: int) -> str:
    """The store key of one chunk (see the module docstring)."""
    if not block_hash:
        raise ValueError("a chunk's block hash must not be empty")
    return f"{block_hash.hex()}.g{group_idx}.{namespace}"


@dataclass(frozen=True, kw_only=True)
class TierOptions:
    """The tier's own entries of its ``secondary_tiers`` config (vLLM takes
    ``type``, ``module_path`` and ``backpressure``):

    - ``storage_url``: the kvferry store (:func:`transfer.storage.open_storage`:
      ``file://`` by default, ``mooncake://``, ``nixl://``);
    - ``batch_chunks``: chunks per store call (a job of more takes several);
    - ``enable_kv_events``: publish chunks found in and gone from the store
      as vLLM KV events (``medium`` STORAGE), when vLLM's KV events are on;
    - ``locality``: ``LOCAL`` or ``REMOTE``, the store relative to this
      server, carried by those events (None: unspecified);
    - ``max_announced_chunks``: how many announced chunks the tier remembers
      to announce their removal (the oldest forgotten first);
    - ``shutdown_timeout_s``: how long ``shutdown`` waits for the store's
      thread to finish its call and close the store.
    """

    storage_url: str = DEFAULT_URL
    batch_chunks: int = 64
    enable_kv_events: bool = False
    locality: str | None = None
    max_announced_chunks: int = 1 << 20
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.storage_url, str) or "://" not in self.storage_url:
            raise ValueError(f"kvferry tier: storage_url must be a store URL (file:///path, mooncake://host:port), "
                             f"got {self.storage_url!r}")
        for name in ("batch_chunks", "max_announced_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kvferry tier: {name} must be a positive int, got {value!r}")
        if not isinstance(self.enable_kv_events, bool):
            raise ValueError(f"kvferry tier: enable_kv_events must be a bool, got {self.enable_kv_events!r}")
        if self.locality not in (None, "LOCAL", "REMOTE"):
            raise ValueError(f"kvferry tier: locality must be LOCAL, REMOTE or absent, got {self.locality!r}")
        if not isinstance(self.shutdown_timeout_s, (int, float)) or self.shutdown_timeout_s <= 0:
            raise ValueError(f"kvferry tier: shutdown_timeout_s must be positive, got {self.shutdown_timeout_s!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TierOptions:
        """From the tier's config entries; an unknown one is a ValueError naming the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"kvferry tier: unknown option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**config)
