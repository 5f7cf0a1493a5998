"""Prefill side: the rank's room table, which routes control messages to its
live senders (:class:`~transfer.rooms.sender.KVSender`), keeps requests that
arrive before their sender exists (:mod:`transfer.rooms.early_messages`),
refuses late requests for rooms that already failed; decode ranks'
handshakes are :mod:`transfer.rooms.decode_peers`.

Nobody outside a room can end it. A request from a session that has not
handshaken (or from another endpoint or origin than its handshake's) is
dropped; a request for a room that already has one from the same decode TP
rank, or all it expects, is refused at once (that receiver gets
``RoomStatus(FAILED)``, the room goes on); a request seen before is
dropped; an abort whose request id the room does not know is taken only
from a decode rank that handshook (or whose handshake was refused for an
incompatible layout: prefill then learns why) and whose request the room
still awaits. Each is
counted (``num_*`` below); none fails a room that others own."""

from __future__ import annotations

import collections
import logging
import time
import weakref
from typing import Protocol
from collections.abc import Callable

from bootstrap.messages import RankInfo
from transfer.errors import PeerError, StateError
from transfer.messages import PeerHello, RoomAbort, RoomHold, RoomStatus, StageGrant, Status, TransferRequest
from transfer.rooms.context import RoomContext
from transfer.rooms.decode_peers import DecodePeers
from transfer.rooms.early_messages import Dropped, EarlyMessages
from transfer.rooms.staged_prefill import PrefillStaging
from transfer.stats import FailureReason, tag_reason

log = logging.getLogger("kvferry.sender")

_REMEMBER_FINISHED = 65536
# Bounds on requests kept for rooms whose sender the scheduler has not created
# yet (a decode rank may be early; a flood must not exhaust memory).
_EARLY_ROOMS = 4096
_EARLY_PER_ROOM = 64
# Request ids kept per decode rank for its next pong.
_MAX_ACKS = 65536
#: The longest one RoomHold keeps a room open for (seconds): decode renews a hold.
MAX_HOLD_S = 120.0


class Sender(Protocol):
    """What the table needs of a room's sender (a :class:`~transfer.rooms.sender.KVSender`)."""

    room: int

    @property
    def terminal(self) -> bool: ...

    @property
    def where(self) -> str: ...

    @property
    def requests(self) -> tuple[TransferRequest, ...]: ...

    @property
    def awaiting_requests(self) -> bool: ...

    def on_message(self, msg) -> None: ...

    def hold(self, until: float) -> None: ...

    def fail(self, error: BaseException) -> None: ...

    def update(self): ...


class PrefillRooms:
    """Routes control messages to the live senders of a prefill rank.

    Requests may arrive before the scheduler creates the room's sender; they
    wait (at most ``bootstrap_timeout_s``) and are handed over on creation.
    Messages for rooms that already ended, matched by (room, request_id), are
    dropped, so a reused room id never picks up a stale request.
    """

    def __init__(self, ctx: RoomContext) -> None:
        self.ctx = ctx
        self.decode_peers = DecodePeers(ctx)  # the handshaken decode ranks
        self.peers: dict[str, RankInfo] = self.decode_peers.peers  # decode session -> its rank info
        #: requests refused because the room has one from that decode TP rank, or all it expects
        self.num_refused_duplicates = 0
        #: requests seen before (same room and request id), dropped
        self.num_dropped_replays = 0
        #: aborts with an unknown request id from a session that may not end the room
        self.num_refused_aborts = 0
        #: RoomHolds taken from handshaken decode ranks (for a live room or not)
        self.num_holds = 0
        self.senders: dict[int, Sender] = {}
        self._every = weakref.WeakSet()  # every sender still referenced (a failed one's writes may be in flight)
        self._early = EarlyMessages(_EARLY_ROOMS, _EARLY_PER_ROOM)
        # Rooms whose sender failed before every decode request arrived: a
        # late request gets the failure at once instead of waiting out its
        # timeout (until a new sender takes the room id, or bootstrap_timeout_s).
        self._refused: dict[int, tuple[float, str]] = {}
        self.num_dropped_early = 0
        self._finished: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        # decode session -> ids of its requests taken since the last pong to it (see PeerPong.acks)
        self._acks: dict[str, list[int]] = {}
        # Also without local staging: a fenced decode rank takes every part in its staging.
        self.staging = PrefillStaging(ctx, self.peers)

    def on_message(self, msg, origin: str = "") -> None:
        """A control message from ``origin`` (see :mod:`transfer.control.base`)."""
        if isinstance(msg, PeerHello):
            self.decode_peers.on_hello(msg, origin)
            return
        if isinstance(msg, StageGrant) and self.staging is not None:
            self.staging.on_grant(msg)
            return
        if isinstance(msg, RoomHold):
            self._on_hold(msg, origin)
            return
        if not isinstance(msg, (TransferRequest, RoomAbort)):
            log.debug("%s: ignored a %s message", self.ctx.where, msg.KIND)
            return
        with self.ctx.lock:
            if (msg.room, msg.request_id) in self._finished:
                if isinstance(msg, TransferRequest):
                    self.dropped_replay()
                return
            sender = self.senders.get(msg.room)
            if isinstance(msg, TransferRequest):
                if not self.is_peer(msg.decode_session, origin, msg.decode_endpoint):
                    self.refused_unhandshaken()
                    log.info("%s: dropped a request for room %d from %s (not handshaken from %s at %s)",
                             self.ctx.where, msg.room, msg.decode_session, origin or "?", msg.decode_endpoint)
                    return
                self._ack(msg)
                if sender is None:
                    if not self._refuse(msg) and not self._early_duplicate(msg):
                        self._keep_early(msg)
                    return
            else:
                known = sender.requests if sender is not None else self._early.requests(msg.room)
                if msg.request_id not in [r.request_id for r in known] and not self.is_peer(msg.session, origin) \
                        and not self.decode_peers.is_incompatible(msg.session, origin):
                    self.num_refused_aborts += 1
                    log.info("%s: ignored an abort of room %d from %s (%s)", self.ctx.where, msg.room,
                             msg.session or "an unnamed session", origin or "?")
                    return
                if sender is None:
                    self._abort_early(msg)
                    self._keep_early(msg)
                    return
        sender.on_message(msg)

    def _on_hold(self, hold: RoomHold, origin: str) -> None:
        """Decode holds ``hold.room`` (its request queued there): the room's
        sender waits for decode requests ``hold_s`` more seconds (at most
        ``MAX_HOLD_S``). Ignored from a decode rank that did not handshake,
        and for a room with no sender."""
        if not self.is_peer(hold.session, origin):
            log.info("%s: ignored a hold of room %d from %s (not handshaken from %s)", self.ctx.where, hold.room,
                     hold.session or "an unnamed session", origin or "?")
            return
        with self.ctx.lock:
            sender = self.senders.get(hold.room)
            self.num_holds += 1
        if sender is not None and hold.hold_s > 0:
            sender.hold(time.monotonic() + min(float(hold.hold_s), MAX_HOLD_S))

    def is_peer(self, session: str, origin: str, endpoint: str | None = None) -> bool:
        """Whether ``session`` handshook (see :meth:`DecodePeers.is_peer`)."""
        return self.decode_peers.is_peer(session, origin, endpoint)

    @property
    def prefill_sessions(self) -> frozenset[str]:
        """This node's prefill ranks' sessions, which no decode peer may declare (set by the manager)."""
        return self.decode_peers.prefill_sessions

    @prefill_sessions.setter
    def prefill_sessions(self, sessions: frozenset[str]) -> None:
        self.decode_peers.prefill_sessions = sessions

    @property
    def num_refused_hellos(self) -> int:
        """Hellos refused for the identity they declared (peer_check)."""
        return self.decode_peers.num_refused_hellos

    def refuse_request(self, req: TransferRequest, reason: str) -> None:
        """Refuse one decode request at once (a duplicate receiver of a live
        room): its receiver fails, the room goes on (under the lock)."""
        self.num_refused_duplicates += 1
        self._finished[(req.room, req.request_id)] = None
        log.warning("%s: refused a request for room %d from decode %s: %s", self.ctx.where, req.room,
                    req.decode_session, reason)
        self._tell_failed(req, f"{self.ctx.where} room {req.room} refused this request: {reason}")

    def _tell_failed(self, req: TransferRequest, reason: str) -> None:
        peer = self.peers.get(req.decode_session)
        if peer is None:
            return  # only handshaken peers are ever written to
        try:
            self.ctx.channel.send(peer.control_endpoint, RoomStatus(
                room=req.room, request_id=req.request_id, prefill_tp_rank=self.ctx.rank.tp_rank,
                status=Status.FAILED, sent=(), reason=reason))
        except Exception as exc:
            log.warning("%s: could not tell decode: %s", self.ctx.where, exc)

    @property
    def num_refused_unhandshaken(self) -> int:
        """Requests from a session that has not handshaken (or not from its
        handshake's endpoint, origin): the rank's ``control_unhandshaken``."""
        return self.ctx.stats.num_unhandshaken

    def refused_unhandshaken(self) -> None:
        """Count a request refused for its session's handshake (here or by its sender)."""
        self.ctx.stats.num_unhandshaken += 1

    def dropped_replay(self) -> None:
        """Count a request seen before (same room and request id), dropped (here or by its sender)."""
        self.num_dropped_replays += 1

    def _early_duplicate(self, req: TransferRequest) -> bool:
        """A request kept early for this room came from the same decode TP
        rank already: refuse the newcomer at once."""
        kept = self._early.from_rank(req)
        if kept is None:
            return False
        if kept.request_id == req.request_id:
            self.dropped_replay()
        else:
            self.refuse_request(req, f"it already has a request from decode TP rank {req.decode_tp_rank}")
        return True

    def refuse_later(self, room: int, reason: str) -> None:
        """The room's sender failed before all its requests arrived."""
        now = time.monotonic()
        if len(self._refused) >= _EARLY_ROOMS:
            horizon = now - self.ctx.config.bootstrap_timeout_s
            for r in [r for r, (t, _) in self._refused.items() if t < horizon] or [next(iter(self._refused))]:
                del self._refused[r]
        self._refused[room] = (now, reason)

    def _refuse(self, req: TransferRequest) -> bool:
        refused = self._refused.get(req.room)
        late = None if refused is None else time.monotonic() - refused[0]
        if late is None or late > self.ctx.config.bootstrap_timeout_s:
            return False
        self._finished[(req.room, req.request_id)] = None
        self._tell_failed(req, f"{self.ctx.where} room {req.room} ended {late:.2f} s before this request arrived: "
                               f"{refused[1]}")
        return True

    def _abort_early(self, abort: RoomAbort) -> None:
        """Decode aborted a room whose sender does not exist yet: nothing was
        written, and decode may hear so at once."""
        for msg in self._early.withdraw(abort.room, abort.request_id):
            self._finished[(msg.room, msg.request_id)] = None
            self._tell_failed(msg, f"{self.ctx.where}: aborted before its sender existed")

    def _keep_early(self, msg) -> None:
        """Keep a message for a room whose sender does not exist yet, within
        bounds (:class:`EarlyMessages`: at most ``_EARLY_ROOMS`` rooms of at
        most ``_EARLY_PER_ROOM`` messages, each for ``bootstrap_timeout_s``).
        A request dropped for these bounds is refused (its receiver fails at
        once), never dropped silently."""
        now = time.monotonic()
        for dropped in self._early.keep(msg, now, now - self.ctx.config.bootstrap_timeout_s):
            self._drop_early(dropped)

    def _drop_early(self, dropped: Dropped) -> None:
        """Drop messages kept for a room whose sender does not exist: each
        request among them is refused, so that its receiver learns of it."""
        for msg in dropped.messages:
            self.num_dropped_early += 1
            if isinstance(msg, TransferRequest):
                self._finished[(msg.room, msg.request_id)] = None
                self._tell_failed(msg, f"{self.ctx.where}: dropped the request for room {msg.room} before the "
                                       f"room's sender existed: {dropped.why}")

    def _ack(self, req: TransferRequest) -> None:
        """``req`` is taken (whatever then becomes of it): its id goes out in
        the next pong to its decode rank (bounded: a peer that stopped pinging
        has given up on what is older)."""
        acks = self._acks.setdefault(req.decode_session, [])
        acks.append(req.request_id)
        if len(acks) > _MAX_ACKS:
            del acks[:len(acks) - _MAX_ACKS]

    def take_acks(self, session: str) -> tuple[int, ...]:
        """The ids of the requests from decode rank ``session`` taken since
        the last call (for its pong; under the lock)."""
        return tuple(self._acks.pop(session, ()))

    def on_pong(self, session: str, acks, pinged_at: float | None) -> None:
        """A decode rank's pong: it acknowledges nothing (liveness only)."""

    def attach(self, sender: Sender) -> list:
        with self.ctx.lock:
            old = self.senders.get(sender.room)
            if old is not None and not old.terminal:
                raise StateError(f"{self.ctx.where}: room {sender.room} already has a live sender")
            self.senders[sender.room] = sender
            self._every.add(sender)
            self._refused.pop(sender.room, None)
            kept, stale = self._early.take(sender.room, time.monotonic() - self.ctx.config.bootstrap_timeout_s)
            self._drop_early(stale)
            return kept

    def detach(self, sender: Sender, request_ids) -> None:
        with self.ctx.lock:
            if self.senders.get(sender.room) is sender:
                del self.senders[sender.room]
            for rid in request_ids:
                self._finished[(sender.room, rid)] = None
            while len(self._finished) > _REMEMBER_FINISHED:
                self._finished.popitem(last=False)

    @property
    def num_live(self) -> int:
        """Rooms with a sender that has not ended."""
        return len(self.senders)

    @property
    def num_early_rooms(self) -> int:
        """Rooms whose decode requests arrived before their sender exists."""
        return len(self._early)

    def endpoint_of(self, session: str) -> str | None:
        """The control endpoint of a handshaken decode rank."""
        return self.decode_peers.endpoint_of(session)

    def live_peers(self, now: float) -> dict[str, str]:
        """Session -> control endpoint of the decode ranks whose requests a
        live sender holds (called under the lock)."""
        return {req.decode_session: req.decode_endpoint
                for s in self.senders.values() if not s.terminal for req in s.requests}

    def peer_lost(self, session: str, why: str, *, gone: bool = False) -> None:
        """A decode rank went silent or is gone (``why``): fail the rooms it asked for
        (``gone`` or not: a decode rank's rooms do not outlive it)."""
        with self.ctx.lock:
            senders = [s for s in self.senders.values()
                       if any(r.decode_session == session for r in s.requests)]
        for s in senders:
            s.fail(tag_reason(PeerError(f"{s.where}: decode rank {session} {why}"), FailureReason.PEER_LOST))

    def expire(self, tick: Callable[[], None] = lambda: None) -> None:
        """Poll the live senders, so that their timeouts fire (the manager's
        liveness thread, every half second or so); ``tick()`` between two."""
        with self.ctx.lock:
            senders = [s for s in self.senders.values() if not s.terminal]
        for s in senders:
            s.update()
            tick()

    def live_rooms(self) -> list:
        """The senders whose writes may still read the pools: live ones, and
        failed ones with writes in flight (under the lock)."""
        return [s for s in list(self._every) if not s.released()]

    def close(self, error: BaseException) -> None:
        with self.ctx.lock:
            senders = list(self.senders.values())
        for s in senders:
            s.fail(error)
