"""The room layer: what happens to rooms between the scheduler API
(:mod:`transfer.sender`, :mod:`transfer.receiver`) and the engines.

- :mod:`~transfer.rooms.context`: :class:`RoomContext`, all the room layer
  gets of its :class:`~transfer.manager.KVManager` (config, rank, lock,
  transport, channel, staging, storage, bootstrap clients);
- :mod:`~transfer.rooms.prefill_table`: a prefill rank's room table (early
  requests, refusals, handshakes);
- :mod:`~transfer.rooms.decode_table`: a decode rank's room table (message
  routing, liveness peers);
- :mod:`~transfer.rooms.links`: links to prefill DP groups and their
  resolution (bootstrap lookup, handshake);
- :mod:`~transfer.rooms.request_acks`: the requests each prefill rank has
  not acknowledged yet, and the rule that finds the lost ones (pure);
- :mod:`~transfer.rooms.decode_phases`: a decode room's phases, a table over
  an Enum (prefetch, drain, restore included);
- :mod:`~transfer.rooms.room_storage`: a decode room's prefetch and restore.

The staged path is :mod:`transfer.staging`, the engines sit behind
:mod:`transfer.transport` and :mod:`transfer.control`. Nothing here imports
zmq or Mooncake (``tests/unit/test_layering.py``); the unit tests drive whole
rooms in one process through the loopback pair.
"""
