"""The ``nixl://`` storage backend: KV pages moved by a NIXL agent straight
between the pool (host memory, or GPU memory through GPUDirect Storage) and
one file per key.

- :mod:`~transfer.storage.nixl.store`: ``NixlStore``, the
  :class:`~transfer.storage.base.StorageBackend`, and ``open_nixl_store``,
  the ``nixl://`` opener (its docstring is the store's contract);
- :mod:`~transfer.storage.nixl.config` (pure): ``NixlStoreConfig``, the
  options of a ``nixl://`` URL;
- :mod:`~transfer.storage.nixl.files`: the page files' format and the file
  system calls around a transfer (``PageFiles``, ``PageEntry``);
- :mod:`~transfer.storage.nixl.agent`: ``NixlAgent``, every NIXL call of the
  store, bounded in time, NIXL's exceptions translated;
- :mod:`~transfer.storage.nixl.probe`: finding NIXL (``import_nixl``, by
  the NIXL transport's ``find_nixl``), whether GPUDirect Storage can run here, and
  the backend choice with its POSIX fallback;
- :mod:`~transfer.storage.nixl.regions` (pure): disjoint registration
  planning (``RegionSet``, ``plan_registration``).

Import names from their modules; this package exports none. Importing the
package or any of its modules imports neither NIXL nor torch: NIXL is
imported when a store opens or a probe (``nixl_missing_reason``,
``gds_unavailable_reason``) runs.
"""
