"""What moved, per room and per rank: the numbers the metrics export and the
engine adapters report. Pure.

Rule: every count is an integer added under the rank's lock (``ctx.lock``)
when something *landed* (a transport job or staged part completed, pages
loaded from storage); nothing is computed on the hot path beyond that. A
room's :class:`RoomCounter` adds into its rank's :class:`RankTotals` at the
same moment, so the rank's totals grow while a long room runs. Snapshots
(:class:`RoomStats`, :class:`ManagerStats`) are frozen copies, safe to keep.

Keys of the byte and descriptor maps are ``(pool, path)``: pool ``target``,
``draft`` or ``aux``; path ``direct`` (descriptors between the pools),
``staged`` (through the staging buffers) or ``storage`` (pages loaded from
the storage tier instead of moved). Descriptors are the plan's, before the
transport cuts long ones; a staged part is one descriptor, counted under the
first pool it carries. Decode cannot see direct writes (they are one-sided):
it counts their bytes when a prefill rank reports its part done (pages x the
page bytes of each pool it sent), and no descriptors for them.

Failure reasons are a bounded enum (:class:`FailureReason`), found by
:func:`failure_reason`: a site may tag its error (:func:`tag_reason`),
otherwise the exception's type decides.
"""

from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass, field

from transfer.errors import (AuthError, BootstrapError, ClosedError, IncompatibleLayoutError, KVTimeoutError,
                             PeerError, ProtocolError, StorageMissError, TransferError)
from transfer.round_times import RoundTimes

POOLS = ("target", "draft", "aux")
PATHS = ("direct", "staged", "storage")


class FailureReason(str, enum.Enum):
    PEER_LOST = "peer_lost"            # the peer went silent (liveness), or left
    REQUEST_LOST = "request_lost"      # a prefill rank acknowledged later messages, not the room's request
    TIMEOUT = "timeout"                # a bootstrap, transfer or storage time bound passed
    REFUSED = "refused"                # the peer refused or failed the room (also a refused lookup)
    ABORTED = "aborted"                # a scheduler aborted it, on either side
    AUTH = "auth"                      # a message or lookup failed authentication
    BOUNDS = "bounds"                  # page indices or sizes outside what the pools hold
    INCOMPATIBLE = "incompatible"      # the handshake found layouts that differ
    STORAGE_MISS = "storage_miss"      # the fallback found pages missing from storage
    CLOSED = "closed"                  # the manager closed
    TRANSFER_ERROR = "transfer_error"  # the engine failed to move bytes
    OTHER = "other"


REASONS = tuple(r.value for r in FailureReason)
_TAG = "kvferry_failure_reason"


def tag_reason(error: BaseException, reason: FailureReason) -> BaseException:
    """Mark ``error`` with the reason its site knows; returns it."""
    setattr(error, _TAG, reason)
    return error


def failure_reason(error: BaseException | None) -> FailureReason:
    """The reason of a room's failure: its site's tag, else its type."""
    tagged = getattr(error, _TAG, None)
    if tagged is not None:
        return tagged
    for types, reason in _BY_TYPE:
        if isinstance(error, types):
            return reason
    return FailureReason.OTHER


_BY_TYPE = (
    (ClosedError, FailureReason.CLOSED),
    (AuthError, FailureReason.AUTH),
    (IncompatibleLayoutError, FailureReason.INCOMPATIBLE),
    (StorageMissError, FailureReason.STORAGE_MISS),
    (KVTimeoutError, FailureReason.TIMEOUT),
    (TransferError, FailureReason.TRANSFER_ERROR),
    (ProtocolError, FailureReason.OTHER),  # before ValueError, which it subclasses
    ((IndexError, ValueError), FailureReason.BOUNDS),
    ((PeerError, BootstrapError), FailureReason.REFUSED),
)

#: Histogram bucket bounds (seconds) of room latency, first byte and prefetch wait.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class Histogram:
    """``counts[i]``: observations <= ``bounds[i]`` (not cumulative); the
    last count is above every bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @property
    def num(self) -> int:
        return sum(self.counts)


class _Hist:
    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(SECONDS_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1  # the first bucket >= seconds
        self.total += seconds

    def snapshot(self) -> Histogram:
        return Histogram(SECONDS_BUCKETS, tuple(self.counts), self.total)


@dataclass(frozen=True)
class RoomStats:
    """One room on one side, at the moment it was taken.

    Times: ``*_at`` are ``time.monotonic()``, ``*_wall`` ``time.time()``;
    ``requested``: the scheduler created the sender / receiver; ``first_byte``:
    the first data landed (prefill: a job or part completed; decode: a staged
    part, a prefill rank's completion, or pages from storage); ``done``: the
    room reached Success or Failed. None: not yet. ``state`` is the poll
    state's name; ``reason`` is set once it is ``Failed``.
    """

    side: str
    room: int
    state: str
    reason: str | None
    bytes: dict[tuple[str, str], int]
    descriptors: dict[tuple[str, str], int]
    num_parts: int
    pages_from_storage: int
    requested_at: float
    requested_wall: float
    first_byte_at: float | None = None
    first_byte_wall: float | None = None
    done_at: float | None = None
    done_wall: float | None = None
    #: decode, successful rooms sent by prefill: from the end of the last prefill rank's forward pass (its
    #: last send(), or that call's ready event completing) to Success, the transfer time a request's first
    #: token waits for (None: not measured)
    exposed_transfer_s: float | None = None
    #: decode: how long the room waited for its prefill ranks to answer the handshake (they answer once their
    #: transport opened its way to this rank: a segment lookup and a probe write); 0 when its link was ready
    handshake_wait_s: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_descriptors(self) -> int:
        return sum(self.descriptors.values())

    def bytes_of(self, *, pool: str | None = None, path: str | None = None) -> int:
        return sum(n for (p, q), n in self.bytes.items() if pool in (None, p) and path in (None, q))

    @property
    def seconds(self) -> float | None:
        """Request to done."""
        return None if self.done_at is None else self.done_at - self.requested_at

    @property
    def first_byte_seconds(self) -> float | None:
        return None if self.first_byte_at is None else self.first_byte_at - self.requested_at


@dataclass(frozen=True)
class ManagerStats:
    """One rank's totals since it started (``KVManager.stats()``).

    ``rooms``: ended rooms by (state, reason), reason ``""`` for Success;
    ``bytes`` / ``descriptors`` by (pool, path) as in :class:`RoomStats`;
    ``live_rooms``: rooms not ended; ``peers_live``: peers under liveness
    watch now, ``peers_lost``: peers given up since start; ``control_*``:
    control messages received, and dropped (malformed, unauthenticated,
    unhandshaken: a request from a decode rank without a handshake);
    ``staging_*``: the staging buffer (0 without one); ``storage_pages``:
    by (op, result): read hit|miss, write written|present|failed;
    ``storage_bytes``: by op (read, write). ``handshake*``: prefill, the
    transport's opens of the way to decode ranks (a segment lookup and a
    probe write each: opened, failed, of those timed out, their seconds,
    running now); decode, this rank's handshakes with prefill ranks
    (answered, refused for a failed open, unanswered within
    ``rpc_timeout_s``, the seconds waited for the answers, waiting now).
    """

    side: str
    rooms: dict[tuple[str, str], int]
    bytes: dict[tuple[str, str], int]
    descriptors: dict[tuple[str, str], int]
    num_parts: int
    room_seconds: Histogram
    first_byte_seconds: Histogram
    prefetch_wait_seconds: Histogram
    exposed_transfer_seconds: Histogram
    live_rooms: int = 0
    peers_live: int = 0
    peers_lost: int = 0
    control_received: int = 0
    control_malformed: int = 0
    control_unauthenticated: int = 0
    control_unhandshaken: int = 0
    staging_bytes_in_use: int = 0
    staging_capacity_bytes: int = 0
    storage_pages: dict[tuple[str, str], int] = field(default_factory=dict)
    storage_bytes: dict[str, int] = field(default_factory=dict)
    handshakes: int = 0
    handshake_failures: int = 0
    handshake_timeouts: int = 0
    handshake_seconds: float = 0.0
    handshakes_in_progress: int = 0
    #: prefill, Mooncake: probe writes that failed on a data connection the engine still pooled for an
    #: earlier process at the peer's address and port (a restarted peer got its old port back; each such
    #: open takes Mooncake's 1 s reconnect cool-down)
    handshake_stale_writes: int = 0
    #: decode: rooms that asked their prefill node afresh, its rank found gone before it took their request
    #: (a killed node restarted; see ``KVReceiver.peer_lost``)
    rooms_relinked: int = 0
    #: rounds of the rank's periodic work by task, and each task's longest round in CPU seconds (a bound
    #: on how long it kept the interpreter lock from the scheduler: see :class:`RoundTimes`)
    periodic_rounds: dict[str, int] = field(default_factory=dict)
    periodic_max_cpu_s: dict[str, float] = field(default_factory=dict)
    #: each task's longest round of each kind (``whole``: no context switch inside, an exact figure;
    #: ``preempted``, ``waited``: upper bounds; see :data:`~transfer.round_times.HOLD_KINDS`)
    periodic_max_by_kind_s: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def rooms_in(self, state: str, reason: str | None = None) -> int:
        return sum(n for (s, r), n in self.rooms.items() if s == state and reason in (None, r))


class RankTotals:
    """One rank's running totals; changed under ``ctx.lock`` only
    (``round_times`` under its own)."""

    def __init__(self, side: str) -> None:
        self.side = side
        self.rooms: dict[tuple[str, str], int] = {}
        self.bytes: dict[tuple[str, str], int] = {}
        self.descriptors: dict[tuple[str, str], int] = {}
        self.num_parts = 0
        self.num_unhandshaken = 0
        self.num_peers_lost = 0
        self.num_relinked = 0
        self.room_seconds, self.first_byte_seconds, self.prefetch_wait_seconds = _Hist(), _Hist(), _Hist()
        self.exposed_transfer_seconds = _Hist()
        self.round_times = RoundTimes()

    def room(self, room: int) -> RoomCounter:
        return RoomCounter(self, room)

    def snapshot(self, **live) -> ManagerStats:
        """A frozen copy (take it under ``ctx.lock``); ``live``: the
        :class:`ManagerStats` fields the manager reads from elsewhere."""
        return ManagerStats(side=self.side, rooms=dict(self.rooms), bytes=dict(self.bytes),
                            descriptors=dict(self.descriptors), num_parts=self.num_parts,
                            room_seconds=self.room_seconds.snapshot(),
                            first_byte_seconds=self.first_byte_seconds.snapshot(),
                            prefetch_wait_seconds=self.prefetch_wait_seconds.snapshot(),
                            exposed_transfer_seconds=self.exposed_transfer_seconds.snapshot(),
                            control_unhandshaken=self.num_unhandshaken, peers_lost=self.num_peers_lost,
                            rooms_relinked=self.num_relinked, **self.round_times.snapshot(), **live)


class RoomCounter:
    """One room's counts; its owner calls it under ``ctx.lock``."""

    __slots__ = ("totals", "room", "bytes", "descriptors", "num_parts", "pages_from_storage", "requested_at",
                 "requested_wall", "first_byte_at", "first_byte_wall", "done_at", "done_wall", "reason",
                 "exposed_transfer_s")

    @property
    def total_bytes(self) -> int:
        """Bytes landed so far, every pool and path."""
        return sum(self.bytes.values())

    def __init__(self, totals: RankTotals, room: int) -> None:
        self.totals, self.room = totals, room
        self.bytes: dict[tuple[str, str], int] = {}
        self.descriptors: dict[tuple[str, str], int] = {}
        self.num_parts = self.pages_from_storage = 0
        self.requested_at, self.requested_wall = time.monotonic(), time.time()
        self.first_byte_at = self.first_byte_wall = self.done_at = self.done_wall = None
        self.reason: FailureReason | None = None
        self.exposed_transfer_s: float | None = None

    def exposed(self, seconds: float) -> None:
        """The room's exposed transfer time (decode, at Success; see :class:`RoomStats`)."""
        self.exposed_transfer_s = max(0.0, seconds)
        self.totals.exposed_transfer_seconds.observe(self.exposed_transfer_s)

    def add(self, pool: str, path: str, num_bytes: int, num_descriptors: int = 0) -> None:
        """Bytes (and descriptors) of ``pool`` that landed by ``path``."""
        key = (pool, path)
        self.bytes[key] = self.bytes.get(key, 0) + num_bytes
        self.totals.bytes[key] = self.totals.bytes.get(key, 0) + num_bytes
        if num_descriptors:
            self.descriptors[key] = self.descriptors.get(key, 0) + num_descriptors
            self.totals.descriptors[key] = self.totals.descriptors.get(key, 0) + num_descriptors
        self.landed()

    def add_part(self) -> None:
        self.num_parts += 1
        self.totals.num_parts += 1

    def landed(self) -> None:
        """Data arrived (sets the first-byte time once)."""
        if self.first_byte_at is None:
            self.first_byte_at, self.first_byte_wall = time.monotonic(), time.time()

    def done(self, error: BaseException | None) -> FailureReason | None:
        """The room ended (``error`` None: Success); counts it once. Returns
        the failure reason."""
        if self.done_at is not None:
            return self.reason
        self.done_at, self.done_wall = time.monotonic(), time.time()
        t = self.totals
        if error is None:
            key = ("Success", "")
            t.room_seconds.observe(self.done_at - self.requested_at)
        else:
            self.reason = failure_reason(error)
            key = ("Failed", self.reason.value)
        if self.first_byte_at is not None:
            t.first_byte_seconds.observe(self.first_byte_at - self.requested_at)
        t.rooms[key] = t.rooms.get(key, 0) + 1
        return self.reason

    def snapshot(self, state: str, handshake_wait_s: float = 0.0) -> RoomStats:
        return RoomStats(side=self.totals.side, room=self.room, state=state, handshake_wait_s=handshake_wait_s,
                         reason=self.reason.value if self.reason is not None else None, bytes=dict(self.bytes),
                         descriptors=dict(self.descriptors), num_parts=self.num_parts,
                         pages_from_storage=self.pages_from_storage, requested_at=self.requested_at,
                         requested_wall=self.requested_wall, first_byte_at=self.first_byte_at,
                         first_byte_wall=self.first_byte_wall, done_at=self.done_at, done_wall=self.done_wall,
                         exposed_transfer_s=self.exposed_transfer_s)


def failure_line(*, side: str, config, room: int, peer: str, reason: FailureReason, error: BaseException,
                 age_s: float) -> str:
    """The one WARNING line of a room failure (``config``: the rank's
    ManagerConfig; ``age_s``: seconds from the scheduler's creating the room
    to its failure): key=value fields first, the error's own message last."""
    return (f"room failed: side={side} node={config.node_id} dp={config.dp_rank} "
            f"tp={config.tp_rank}/{config.tp_size} room={room} peer={peer or '-'} reason={reason.value} "
            f"age={age_s:.2f}s error={type(error).__name__}: {error}")
