"""The room layer: the requests a rank moves, from the scheduler API to the
engines. One folder of plain collaborators, each handed what it needs.

Prefill:

- :mod:`~transfer.rooms.sender`: :class:`KVSender`, one per request, with
  its collaborators: :mod:`~transfer.rooms.chunk_sequence` (``init``'s count,
  the chunks and their layer groups), :mod:`~transfer.rooms.room_requests`
  (the decode requests a room takes, refuses or holds),
  :mod:`~transfer.rooms.room_writes` (its writes, write-through and landed
  bytes), :mod:`~transfer.rooms.decode_notice` (the completion decode is
  told), all pure;
- :mod:`~transfer.rooms.chunk_plan`: a chunk planned into direct jobs and
  staged parts (pure); :mod:`~transfer.rooms.parts`: a staged part, a type
  per kind (pure);
- :mod:`~transfer.rooms.staged_prefill`: the staged parts' message flow
  (StageRequest, StageGrant, the write, ChunkStaged);
- :mod:`~transfer.rooms.write_through`: sent pages written to the storage tier;
- :mod:`~transfer.rooms.prefill_table`: the rank's room table (refusals,
  handshakes, acknowledgements; :mod:`~transfer.rooms.early_messages` the
  messages of rooms whose sender does not exist yet, pure);
- :mod:`~transfer.rooms.peer_check`: who may be a decode peer.

Decode:

- :mod:`~transfer.rooms.receiver`: :class:`KVReceiver`, one per request,
  with its collaborators: :mod:`~transfer.rooms.decode_link` (its link,
  relink and peer's name, pure), :mod:`~transfer.rooms.decode_transfer`
  (requests sent to Success), :mod:`~transfer.rooms.decode_ending` (drain,
  restore, Failed, pure), :mod:`~transfer.rooms.decode_storage` (its
  prefetch and fallback steps);
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
