"""kvferry's storage tier: KV pages stored and loaded by prefix-hash keys.

- :mod:`~transfer.storage.keys` (pure): :class:`PoolFingerprint`, :func:`page_keys`;
- :mod:`~transfer.storage.base`: the :class:`StorageBackend` interface and
  :func:`open_storage`, which picks a backend by URL (``file://``,
  ``mooncake://``, ``nixl://``);
- :mod:`~transfer.storage.segments`: a pool's pages as ``(address, nbytes)`` segments;
- backends: :mod:`~transfer.storage.file` (a module), the packages
  :mod:`~transfer.storage.mooncake` and :mod:`~transfer.storage.nixl`.

Names are imported lazily: importing ``transfer.storage.keys`` loads neither
torch nor Mooncake.
"""

from bootstrap.lazy import lazy_exports

_EXPORTS = {
    "PoolFingerprint": "transfer.storage.keys", "page_keys": "transfer.storage.keys",
    "chain_hashes": "transfer.storage.keys", "keys_from_chain": "transfer.storage.keys",
    "Segment": "transfer.storage.base", "StorageBackend": "transfer.storage.base",
    "open_storage": "transfer.storage.base", "register_scheme": "transfer.storage.base",
    "pages_segments": "transfer.storage.segments", "page_segments": "transfer.storage.segments",
    "pool_regions": "transfer.storage.segments", "pool_fingerprint": "transfer.storage.segments",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
