"""Prefill side: the rank's room table, which routes control messages to its
live senders (:class:`~transfer.sender.KVSender`), keeps requests that arrive
before their sender exists, refuses late requests for rooms that already
failed, and answers decode ranks' handshakes."""

from __future__ import annotations

import collections
import logging
import time
from typing import Protocol

from bootstrap.messages import RankInfo
from transfer.errors import IncompatibleLayoutError, PeerError, StateError
from transfer.layout import check_compatible
from transfer.messages import PeerHello, PeerHelloReply, RoomAbort, RoomStatus, StageGrant, Status, TransferRequest
from transfer.rooms.context import RoomContext
from transfer.staging.prefill_flow import PrefillStaging
from transfer.stats import FailureReason, tag_reason

log = logging.getLogger("kvferry.sender")

_REMEMBER_FINISHED = 65536
# Bounds on requests kept for rooms whose sender the scheduler has not created
# yet (a decode rank may be early; a flood must not exhaust memory).
_EARLY_ROOMS = 4096
_EARLY_PER_ROOM = 64


class Sender(Protocol):
    """What the table needs of a room's sender (a :class:`~transfer.sender.KVSender`)."""

    room: int

    @property
    def terminal(self) -> bool: ...

    @property
    def where(self) -> str: ...

    @property
    def requests(self) -> tuple[TransferRequest, ...]: ...

    def on_message(self, msg) -> None: ...

    def fail(self, error: BaseException) -> None: ...

    def poll(self): ...


class PrefillRooms:
    """Routes control messages to the live senders of a prefill rank.

    Requests may arrive before the scheduler creates the room's sender; they
    wait (at most ``bootstrap_timeout_s``) and are handed over on creation.
    Messages for rooms that already ended, matched by (room, request_id), are
    dropped, so a reused room id never picks up a stale request.
    """

    def __init__(self, ctx: RoomContext) -> None:
        self.ctx = ctx
        self.peers: dict[str, RankInfo] = {}  # decode session -> its rank info
        self.senders: dict[int, Sender] = {}
        self._early: dict[int, list[tuple[float, object]]] = {}  # insertion order = age
        # Rooms whose sender failed before every decode request arrived: a
        # late request gets the failure at once instead of waiting out its
        # timeout (until a new sender takes the room id, or bootstrap_timeout_s).
        self._refused: dict[int, tuple[float, str]] = {}
        self.num_dropped_early = 0
        self._finished: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        # Also without local staging: a fenced decode rank takes every part in its staging.
        self.staging = PrefillStaging(ctx, self.peers)

    def on_message(self, msg) -> None:
        if isinstance(msg, PeerHello):
            self._on_hello(msg)
            return
        if isinstance(msg, StageGrant) and self.staging is not None:
            self.staging.on_grant(msg)
            return
        if not isinstance(msg, (TransferRequest, RoomAbort)):
            log.debug("%s: ignored a %s message", self.ctx.where, msg.KIND)
            return
        with self.ctx.lock:
            if (msg.room, msg.request_id) in self._finished:
                return
            sender = self.senders.get(msg.room)
            if sender is None:
                if isinstance(msg, TransferRequest) and self._refuse(msg):
                    return
                if isinstance(msg, RoomAbort):
                    self._abort_early(msg)
                self._keep_early(msg)
                return
        sender.on_message(msg)

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
        if refused is None or time.monotonic() - refused[0] > self.ctx.config.bootstrap_timeout_s:
            return False
        self._finished[(req.room, req.request_id)] = None
        peer = self.peers.get(req.decode_session)
        if peer is not None:
            try:
                self.ctx.channel.send(peer.control_endpoint, RoomStatus(
                    room=req.room, request_id=req.request_id, prefill_tp_rank=self.ctx.rank.tp_rank,
                    status=Status.FAILED, sent=(), reason=f"{self.ctx.where} room {req.room} ended before this "
                                                         f"request arrived: {refused[1]}"))
            except Exception as exc:
                log.warning("%s: could not tell decode: %s", self.ctx.where, exc)
        return True

    def _abort_early(self, abort: RoomAbort) -> None:
        """Decode aborted a room whose sender does not exist yet: nothing was
        written, and decode may hear so at once."""
        kept = self._early.get(abort.room, [])
        for t, msg in list(kept):
            if isinstance(msg, TransferRequest) and msg.request_id == abort.request_id:
                kept.remove((t, msg))
                self._finished[(msg.room, msg.request_id)] = None
                peer = self.peers.get(msg.decode_session)
                if peer is None:
                    continue  # only handshaken peers are ever written to
                try:
                    self.ctx.channel.send(peer.control_endpoint, RoomStatus(
                        room=msg.room, request_id=msg.request_id, prefill_tp_rank=self.ctx.rank.tp_rank,
                        status=Status.FAILED, sent=(), reason=f"{self.ctx.where}: aborted before its sender existed"))
                except Exception as exc:
                    log.warning("%s: could not tell decode: %s", self.ctx.where, exc)

    def _keep_early(self, msg) -> None:
        """Keep a message for a room whose sender does not exist yet, within
        bounds: at most ``_EARLY_ROOMS`` rooms (the oldest go first) of at
        most ``_EARLY_PER_ROOM`` messages, each for ``bootstrap_timeout_s``."""
        now = time.monotonic()
        horizon = now - self.ctx.config.bootstrap_timeout_s
        if len(self._early) >= _EARLY_ROOMS:
            for room in [r for r, msgs in self._early.items() if msgs[-1][0] < horizon]:
                del self._early[room]
            while len(self._early) >= _EARLY_ROOMS:
                del self._early[next(iter(self._early))]
                self.num_dropped_early += 1
        kept = self._early.setdefault(msg.room, [])
        if len(kept) >= _EARLY_PER_ROOM:
            self.num_dropped_early += 1
            return
        kept.append((now, msg))

    def _on_hello(self, hello: PeerHello) -> None:
        try:
            check_compatible(self.ctx.rank, hello.rank, local_is_prefill=True,
                             allow_missing_draft=hello.allow_missing_draft)
        except IncompatibleLayoutError as exc:
            log.error("%s: refused decode rank %s: %s", self.ctx.where, hello.rank.session, exc)
            reply = PeerHelloReply(session=self.ctx.rank.session, ok=False, field=exc.field,
                                   reason=f"{self.ctx.where}: {exc}")
        else:
            with self.ctx.lock:
                self.peers[hello.rank.session] = hello.rank
            reply = PeerHelloReply(session=self.ctx.rank.session, ok=True, field="", reason="")
        self.ctx.channel.send(hello.rank.control_endpoint, reply)

    def attach(self, sender: Sender) -> list:
        with self.ctx.lock:
            old = self.senders.get(sender.room)
            if old is not None and not old.terminal:
                raise StateError(f"{self.ctx.where}: room {sender.room} already has a live sender")
            self.senders[sender.room] = sender
            self._refused.pop(sender.room, None)
            horizon = time.monotonic() - self.ctx.config.bootstrap_timeout_s
            return [m for t, m in self._early.pop(sender.room, []) if t >= horizon]

    def detach(self, sender: Sender, request_ids) -> None:
        with self.ctx.lock:
            if self.senders.get(sender.room) is sender:
                del self.senders[sender.room]
            for rid in request_ids:
                self._finished[(sender.room, rid)] = None
            while len(self._finished) > _REMEMBER_FINISHED:
                self._finished.popitem(last=False)

    def endpoint_of(self, session: str) -> str | None:
        """The control endpoint of a handshaken decode rank."""
        peer = self.peers.get(session)
        return peer.control_endpoint if peer is not None else None

    def live_peers(self, now: float) -> dict[str, str]:
        """Session -> control endpoint of the decode ranks whose requests a
        live sender holds (called under the lock)."""
        return {req.decode_session: req.decode_endpoint
                for s in self.senders.values() if not s.terminal for req in s.requests}

    def peer_lost(self, session: str, silent_s: float) -> None:
        """A decode rank went silent: fail the rooms it asked for."""
        with self.ctx.lock:
            senders = [s for s in self.senders.values()
                       if any(r.decode_session == session for r in s.requests)]
        for s in senders:
            s.fail(tag_reason(PeerError(f"{s.where}: decode rank {session} silent for more than {silent_s:g} s: "
                                        "dead, stopped or unreachable"), FailureReason.PEER_LOST))

    def expire(self) -> None:
        """Poll the live senders, so that their timeouts fire (the manager's
        liveness thread, every half second or so)."""
        with self.ctx.lock:
            senders = [s for s in self.senders.values() if not s.terminal]
        for s in senders:
            s.poll()

    def close(self, error: BaseException) -> None:
        with self.ctx.lock:
            senders = list(self.senders.values())
        for s in senders:
            s.fail(error)
