"""The room layer: the requests a rank moves, from the scheduler API to the
engines. One folder of plain collaborators, each handed what it needs.

Prefill:

- :mod:`~transfer.rooms.sender`: :class:`KVSender`, one per request;
- :mod:`~transfer.rooms.chunk_plan`: a chunk planned into direct jobs and
  staged parts (pure);
- :mod:`~transfer.rooms.staged_prefill`: the staged parts' message flow
  (StageRequest, StageGrant, the write, ChunkStaged);
- :mod:`~transfer.rooms.write_through`: sent pages written to the storage tier;
- :mod:`~transfer.rooms.prefill_table`: the rank's room table (early
  requests, refusals, handshakes, acknowledgements);
- :mod:`~transfer.rooms.peer_check`: who may be a decode peer.

Decode:

- :mod:`~transfer.rooms.receiver`: :class:`KVReceiver`, one per request;
- :mod:`~transfer.rooms.decode_phases`: a decode room's phases, a table over
  an Enum (pure); :mod:`~transfer.rooms.drain`: a failing room's drain (pure);
- :mod:`~transfer.rooms.decode_request`: what a decode room asks of its prefill ranks (pure);
- :mod:`~transfer.rooms.room_storage`: a room's prefetch and restore;
- :mod:`~transfer.rooms.staged_decode`: staging grants and the scatter of
  what lands;
- :mod:`~transfer.rooms.decode_table`: the rank's room table (message
  routing, liveness peers);
- :mod:`~transfer.rooms.links`: links to prefill DP groups and their
  resolution (bootstrap lookup, handshake);
- :mod:`~transfer.rooms.request_acks`: the requests each prefill rank has
  not acknowledged yet, and the rule that finds the lost ones (pure).

Both: :mod:`~transfer.rooms.context` (:class:`RoomContext`, all the room
layer gets of its :class:`~transfer.manager.KVManager`) and
:mod:`~transfer.rooms.room_stats` (what a room's bytes are).

Staging memory is :mod:`transfer.staging`, the engines sit behind
:mod:`transfer.transport` and :mod:`transfer.control`. Nothing here imports
zmq or Mooncake (``tests/unit/test_layering.py``); the unit tests drive whole
rooms in one process through the loopback pair.
"""
