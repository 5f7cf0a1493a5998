"""What a :class:`~transfer.manager.KVManager` runs for its rank, besides its
rooms, each an object with its own state and thread, handed what it needs:

- :mod:`~transfer.rank.registration`: a prefill rank's entry at the
  bootstrap server (register, keep fresh, unregister);
- :mod:`~transfer.rank.watch`: the liveness watch over the peers of live
  rooms (pings, pongs, silent peers, timeout sweeps);
- :mod:`~transfer.rank.metrics`: Prometheus ``/metrics`` of the rank's
  :class:`~transfer.stats.ManagerStats`.
"""
