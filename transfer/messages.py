"""Peer-to-peer control messages between a decode rank and a prefill rank.

They share the one codec (:mod:`bootstrap.codec`) and its version with the
bootstrap messages. Flow for one room::

    decode                               prefill
    PeerHello (once per peer)  ------->  checks layouts
                               <-------  PeerHelloReply (ok, or the field that differs)
    TransferRequest (per room) ------->  waits for all expected requests, then sends
                               <-------  RoomStatus (success or failure, per prefill rank)
    RoomAbort (either side)    <------>  the room fails on the other side too
    RoomHold (before a request) ------->  decode has the room's request queued: prefill
                                         keeps the room open a while longer (renewed)
    PeerPing / PeerPong        <------>  liveness, while rooms are live (either side); prefill's
                                         pongs acknowledge the requests it took since the last
                               <-------  PeerBye (prefill closing: forget links through it)

A prefill rank whose room failed (for any reason, an abort from decode
included) sends ``RoomStatus(FAILED)`` only once none of the room's writes
is in flight any more: decode takes it as the promise that no later byte
lands in the room's pages.

A room is identified by (``room``, ``request_id``): ``request_id`` is random
per receiver, so a reused room id never matches a stale message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from bootstrap.codec import message, struct
from bootstrap.descriptors import OMIT_DEFAULT
from bootstrap.messages import PoolRole, RankInfo


#: how page and state item index lists travel (``TransferRequest.dst_pages``, ``dst_states``)
#: and how decode keeps them: little-endian int32, as a numpy dtype
INDEX_DTYPE = "<i4"
INDEX_ITEMSIZE = 4


@message("peer_hello")
@dataclass(frozen=True)
class PeerHello:
    """A decode rank introduces itself and its pools to a prefill rank.
    ``transport_meta``: what the prefill rank's transport needs to write into
    this rank's registered memory (NIXL: the agent's metadata and its
    registered regions; empty for Mooncake, whose engines handshake on their
    own). A decode rank whose registered memory changed (a fenced rank's
    fresh staging arena) sends a new hello to the prefill ranks it
    handshook with, before any grant names the new memory."""

    rank: RankInfo
    allow_missing_draft: bool
    transport_meta: bytes = field(default=b"", metadata=OMIT_DEFAULT, repr=False)


@message("peer_hello_reply")
@dataclass(frozen=True)
class PeerHelloReply:
    """``ok``, or ``field`` and ``reason`` of the incompatibility."""

    session: str
    ok: bool
    field: str
    reason: str


@struct
@dataclass(frozen=True)
class PoolAssignment:
    """What one prefill rank sends of one pool to one decode rank. ``send`` is
    explicit: False means this rank completes the room without sending it."""

    role: PoolRole
    send: bool
    src_head_offset: int
    dst_head_offset: int
    num_heads: int

    def __post_init__(self) -> None:
        if self.src_head_offset < 0 or self.dst_head_offset < 0:
            raise ValueError("head offsets must be >= 0")
        if self.send and self.num_heads < 1:
            raise ValueError("a pool that is sent needs num_heads >= 1")


@message("transfer_request")
@dataclass(frozen=True)
class TransferRequest:
    """Decode asks a prefill rank to fill ``dst_pages`` (decode page ids, in
    the order of the request's pages) and aux row ``dst_aux_index`` (-1: this
    rank does not send the aux row; exactly one contacted rank does).
    ``num_requests`` is how many decode ranks send a request for this room to
    this prefill rank; it starts sending once all arrived. ``skip_pages``: the
    request's leading pages decode already has (held by its scheduler, or
    prefetched from storage); prefill sends only the rest (the aux row
    always). ``prefix_pages`` (at most ``skip_pages``): of those, the ones
    the decode scheduler said it holds (``KVReceiver.init(skip_pages=)``),
    which the prefill scheduler reads as ``KVSender.decode_prefix_pages``.

    ``staging_offset`` (-1: none): a region of ``staging_nbytes`` of the
    (fenced) decode rank's staging, granted with the request for everything
    this prefill rank sends of the room, packed as staged parts are, from
    request page ``skip_pages`` on: its parts go there without a
    StageRequest each (none when the staging had no room for it).

    ``dst_states``: per state pool of the rank (in order), decode's item
    indices (little-endian int32) this prefill rank is to fill with the
    room's last chunk; empty: it sends none of that state (every state pool
    has exactly one sending rank per decode rank). Empty altogether without
    state pools."""

    room: int
    request_id: int
    decode_session: str
    decode_endpoint: str
    decode_tp_rank: int
    dst_pages: bytes  # little-endian int32
    dst_aux_index: int
    assignments: tuple[PoolAssignment, ...]
    num_requests: int
    skip_pages: int = 0
    prefix_pages: int = 0
    staging_offset: int = -1
    staging_nbytes: int = 0
    dst_states: tuple[bytes, ...] = field(default=(), metadata=OMIT_DEFAULT)

    def __post_init__(self) -> None:
        if len(self.dst_pages) % INDEX_ITEMSIZE:
            raise ValueError("dst_pages must be little-endian int32")
        if any(len(s) % INDEX_ITEMSIZE for s in self.dst_states):
            raise ValueError("dst_states must be little-endian int32")
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if not 0 <= self.skip_pages <= len(self.dst_pages) // INDEX_ITEMSIZE:
            raise ValueError("skip_pages must be within the request's pages")
        if not 0 <= self.prefix_pages <= self.skip_pages:
            raise ValueError("prefix_pages must be within skip_pages")
        if self.staging_offset < -1 or self.staging_nbytes < 0 or (self.staging_offset >= 0) != (self.staging_nbytes > 0):
            raise ValueError("a staging grant needs an offset >= 0 and nbytes > 0 (offset -1: none)")


class Status(str, enum.Enum):
    SUCCESS = "success"
    FAILED = "failed"


@message("room_status")
@dataclass(frozen=True)
class RoomStatus:
    """A prefill rank's terminal state for a room, sent after the bytes landed.
    ``sent`` lists the pools it actually wrote. ``aborted``: the prefill
    scheduler cancelled the request (decode does not restore it from storage).
    ``aux_row``: for a fenced decode rank (nothing of its memory but staging
    is writable), the aux row itself, which decode copies into the room's slot.
    ``exposed_s``: with a success, the seconds from the end of the rank's
    forward pass (its last ``send()``, or that call's ready event completing)
    to this status (every write landed); decode adds its own time to
    Success: the room's exposed transfer time."""

    room: int
    request_id: int
    prefill_tp_rank: int
    status: Status
    sent: tuple[PoolRole, ...]
    reason: str
    aborted: bool = False
    aux_row: bytes = b""
    exposed_s: float = 0.0


@message("room_abort")
@dataclass(frozen=True)
class RoomAbort:
    """The sender of this message gave up on the room; the receiver fails it.
    ``session``: the aborting rank's transfer session. A prefill rank takes a
    decode abort whose ``request_id`` it does not know yet (decode gave up
    before its request went out) only from a handshaken decode rank whose
    request the room still awaits."""

    room: int
    request_id: int
    reason: str
    session: str = ""


@message("room_hold")
@dataclass(frozen=True)
class RoomHold:
    """Decode holds a room it has not asked for yet: the request waits in
    decode's scheduler (a queue, no pages allocated). The prefill ranks keep
    the room open ``hold_s`` seconds from now, past their wait for decode
    requests (``bootstrap_timeout_s``, the vLLM connector's lease); decode
    renews the hold until it asks or cancels, so a decode rank that dies
    lets the room end. A hold for a room with no sender (not opened yet, or
    ended) is ignored; so is one from a decode rank that did not handshake.
    ``session``: the holding decode rank's."""

    room: int
    session: str
    hold_s: float


@message("peer_ping")
@dataclass(frozen=True)
class PeerPing:
    """Are you alive? ``endpoint`` is where to answer; ``session`` says who asks."""

    session: str
    endpoint: str
    seq: int


@message("peer_pong")
@dataclass(frozen=True)
class PeerPong:
    """The answer to a PeerPing; ``session`` is the answering rank's.

    ``acks``: the request ids of the TransferRequests from the pinging rank
    that this (prefill) rank took since its last pong to it: taken into a
    room, kept for a sender not created yet, or answered with a RoomStatus.
    A rank handles a peer's messages in the order that peer sent them, so a
    request sent before a ping is either acknowledged by that ping's pong (or
    an earlier one) or lost: decode fails its room at once instead of
    waiting out ``transfer_timeout_s``."""

    session: str
    seq: int
    acks: tuple[int, ...] = ()


@message("peer_bye")
@dataclass(frozen=True)
class PeerBye:
    """A prefill rank is closing (its rooms were failed and told already):
    decode forgets the links through ``session`` at once, so that the next
    room looks the node up afresh instead of waiting on a dead rank."""

    session: str


@message("stage_request")
@dataclass(frozen=True)
class StageRequest:
    """Prefill asks decode for ``nbytes`` of its staging buffer for part
    ``part`` of a room (a run of the request's pages, gathered)."""

    room: int
    request_id: int
    prefill_tp_rank: int
    prefill_endpoint: str
    part: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.nbytes <= 0:
            raise ValueError("nbytes must be > 0")


@message("stage_grant")
@dataclass(frozen=True)
class StageGrant:
    """Decode reserved ``nbytes`` at ``offset`` of its staging buffer."""

    room: int
    request_id: int
    part: int
    offset: int


@dataclass(frozen=True)
class ChunkStaged:
    """A staged part landed in decode's staging at ``offset``, ``nbytes``
    (the region it was written to: its own, or its slot of the room's
    region granted with the request). Decode scatters it and frees the
    region. Never sent itself: one message kind per part kind
    (:mod:`transfer.rooms.parts`), each naming what it holds."""

    room: int
    request_id: int
    prefill_tp_rank: int
    part: int
    offset: int
    nbytes: int


@message("pages_staged")
@dataclass(frozen=True)
class PagesStaged(ChunkStaged):
    """Pages ``page_start .. page_start + num_pages`` of the request (in
    request order), packed pool by pool as decode asked this prefill rank."""

    page_start: int
    num_pages: int


@message("share_staged")
@dataclass(frozen=True)
class ShareStaged(ChunkStaged):
    """A layer group's share of the part of pages ``page_start ..
    page_start + num_pages``: only room layers ``layers`` (target, then
    draft), a layer-wise send. In a region granted with the request,
    ``offset`` and ``nbytes`` are the part's slot and each layer lies at its
    place in the part's packing; in a region the share asked for, its layers
    are packed one after the other."""

    page_start: int
    num_pages: int
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a layer share names its layers")


@message("state_staged")
@dataclass(frozen=True)
class StateStaged(ChunkStaged):
    """Items ``item_start .. item_start + num_items`` of the request's list
    for state pool ``state_pool`` (in the rank's ``states`` order), packed
    buffer by buffer."""

    state_pool: int
    item_start: int
    num_items: int
