"""The ``mooncake://`` storage backend: KV pages in a Mooncake Store
cluster's pooled memory, through a ``mooncake_master``.

- :mod:`~transfer.storage.mooncake.store`: ``MooncakeStore``, the
  :class:`~transfer.storage.base.StorageBackend`, and
  ``open_mooncake_store``, the ``mooncake://`` opener (its docstring is the
  store's contract: the Store calls used, overwrites, time bounds);
- :mod:`~transfer.storage.mooncake.config` (pure): ``MooncakeStoreConfig``,
  the options of a ``mooncake://`` URL;
- :mod:`~transfer.storage.mooncake.client`: ``StoreClient``, the Store's
  client on its own worker thread, every call bounded in time, and the
  Store's result codes (``code_name``, ``check_master``);
- :mod:`~transfer.storage.mooncake.plan` (pure): how a batch of keys
  becomes Store calls (``entry_chunks``, ``bounce_batches``,
  ``pointers_and_sizes``).

Import names from their modules; this package exports none. Only
:mod:`~transfer.storage.mooncake.store` imports Mooncake, when a store opens:
importing the package or any of its modules imports neither Mooncake nor
torch.
"""
