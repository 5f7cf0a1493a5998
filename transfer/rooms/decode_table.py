"""Decode side: the rank's room table. It holds the live receivers
(:class:`~transfer.rooms.receiver.KVReceiver`) by (room, request id), routes the
control messages that arrive to them, to the link resolver
(:mod:`transfer.rooms.links`) and to the staged flow
(:mod:`transfer.rooms.staged_decode`), and reports which prefill ranks to
watch for liveness."""

from __future__ import annotations

import logging
import time
from typing import Protocol
from collections.abc import Callable

from transfer.errors import KVFerryError
from transfer.messages import ChunkStaged, PeerBye, PeerHelloReply, RoomAbort, RoomHold, RoomStatus, StageRequest
from transfer.plan import page_slice, staged_bytes
from transfer.rooms.context import RoomContext
from transfer.rooms.decode_phases import DecodePhase
from transfer.rooms.links import Link, LinkResolver, LinkState
from transfer.rooms.peer_check import same_host
from transfer.rooms.request_acks import UnackedRequests
from transfer.rooms.staged_decode import DecodeStaging

log = logging.getLogger("kvferry.receiver")


class Receiver(Protocol):
    """What the table needs of a room's receiver (a :class:`~transfer.rooms.receiver.KVReceiver`)."""

    room: int
    request_id: int

    @property
    def link(self) -> Link | None: ...

    @property
    def phase(self) -> DecodePhase: ...

    @property
    def created(self) -> float:
        """When the receiver was made (``time.monotonic()``): the room's age."""

    def ranks_writing(self) -> set[int]: ...

    @property
    def writers_lost(self) -> bool:
        """Whether the room ended without every prefill rank's word that it
        stopped writing (a lost, hung or untold rank)."""

    def update(self): ...

    def on_message(self, msg) -> None: ...


    def peer_lost(self, session: str, why: str, *, gone: bool = False) -> None: ...

    def fail(self, error: BaseException, *, drain: bool = True) -> None: ...

    def request_lost(self, tp_rank: int) -> None:
        """Prefill rank ``tp_rank`` never took the room's request (see
        :mod:`transfer.rooms.request_acks`)."""


class DecodeRooms:
    def __init__(self, ctx: RoomContext) -> None:
        self.ctx = ctx
        self.receivers: dict[tuple[int, int], Receiver] = {}
        self.staging = DecodeStaging(ctx, self._created,
                                     quarantine_s=2.0 * ctx.config.engine.progress_timeout_s) \
            if ctx.staging is not None else None
        self.links = LinkResolver(ctx, kick=self._kick, tick=self._tick)
        # Aborts of rooms that failed before their link was known:
        # (deadline, bootstrap addr, node, dp rank, abort), sent once it is.
        self._pending_aborts: list[tuple[float, str, str, int | None, RoomAbort]] = []
        #: PeerBye messages whose origin did not match their session's host
        self.num_refused_byes = 0
        #: requests sent and not yet acknowledged by their prefill rank
        self.unacked: UnackedRequests[Receiver] = UnackedRequests()
        #: requests found lost (a later ping answered without their acknowledgement)
        self.num_lost_requests = 0

    def _created(self, room: int, request_id: int) -> float | None:
        """When the live receiver of a room was made (None: none is live); under ``ctx.lock``."""
        receiver = self.receivers.get((room, request_id))
        return None if receiver is None else receiver.created

    # --- used by receivers (under ctx.lock) ------------------------------------------

    def add(self, receiver: Receiver) -> None:
        self.receivers[(receiver.room, receiver.request_id)] = receiver

    def remove(self, receiver: Receiver, *, writers_lost: bool | None = None) -> None:
        """The room ended (or drops its request to ask afresh): it gets no
        more messages, and its staging regions still granted go to quarantine
        (fenced: are freed, or poisoned when its writers were lost:
        ``writers_lost``, else the receiver's own word)."""
        self.receivers.pop((receiver.room, receiver.request_id), None)
        link = receiver.link
        if link is not None:
            for p in link.routes:
                if p in link.ranks:
                    self.unacked.forget(link.ranks[p].session, receiver.request_id)
        if self.staging is not None:
            self.staging.release_room(receiver.room, receiver.request_id,
                                      receiver.writers_lost if writers_lost is None else writers_lost)

    def link(self, addr: str, node: str, dp_rank: int | None, room: int) -> Link | None:
        """The link for a room; None while the node's DP size is unknown."""
        return self.links.link(addr, node, dp_rank, room)

    def pregrant(self, receiver: Receiver, tp_rank: int, assignments, num_pages: int) -> tuple[int, int]:
        """(offset, nbytes) of a staging region for everything prefill rank
        ``tp_rank`` sends of ``num_pages`` pages of ``receiver``'s room
        (packed as staged parts are), granted with its request; (-1, 0) when
        this rank is not fenced, the rank sends nothing, or staging has no room."""
        if self.staging is None or not self.ctx.staging.fenced:
            return -1, 0
        per_page = 0
        for a in assignments:
            if a.send:
                pool = self.ctx.rank.pool(a.role)
                per_page += staged_bytes(pool, page_slice(pool, a.dst_head_offset, a.num_heads), 1)
        offset = self.staging.pregrant(receiver.room, receiver.request_id, tp_rank, per_page * num_pages)
        return (offset, per_page * num_pages) if offset >= 0 else (-1, 0)

    def request_sent(self, receiver: Receiver, tp_rank: int, session: str) -> None:
        """``receiver``'s request went to prefill rank ``tp_rank`` (called
        once it is queued): it awaits that rank's acknowledgement."""
        self.unacked.sent(session, receiver.request_id, receiver, tp_rank, time.monotonic())

    def forget(self, link: Link) -> None:
        self.links.forget(link)

    def tell_prefill(self, link: Link, msg: RoomAbort | RoomHold, where: str) -> set[int]:
        """Send ``msg`` (the room is over, or held) to every prefill rank of
        the room, also those a failed handshake kept the room from sending a
        request to; returns the ranks that could not be told."""
        untold = set()
        for p in link.routes or link.ranks:
            try:
                self.ctx.channel.send(link.ranks[p].control_endpoint, msg)
            except KVFerryError as exc:
                log.warning("%s: could not tell prefill rank %d: %s", where, p, exc)
                untold.add(p)
        return untold

    def hold(self, addr: str, node: str, dp_rank: int | None, room: int, hold_s: float) -> bool:
        """Tell the prefill ranks this rank takes ``room`` from that decode
        holds it for ``hold_s`` seconds (``RoomHold``: the request waits in
        decode's queue). False while the prefill node is being looked up or
        its link failed: the caller asks again at its next renewal."""
        with self.ctx.lock:
            link = self.links.link(addr, node, dp_rank, room)
            if link is not None and link.state is LinkState.FAILED:
                self.forget(link)  # looked up afresh at the next renewal, not kept failed for the room
            if link is None or link.state is not LinkState.READY:
                return False
            self.tell_prefill(link, RoomHold(room=room, session=self.ctx.rank.session, hold_s=hold_s),
                              f"{self.ctx.where} room {room}")
        return True

    def abort_when_resolved(self, addr: str, node: str, dp_rank: int | None, abort: RoomAbort) -> None:
        """A room failed before its link was known (``abort()`` before the
        first ``poll()``, bad page ids at ``init()``): look the prefill node
        up and tell its ranks as soon as the link is ready (within
        ``bootstrap_timeout_s``), so that prefill does not wait out its own
        timeout."""
        deadline = time.monotonic() + self.ctx.config.bootstrap_timeout_s
        self._pending_aborts.append((deadline, addr, node, dp_rank, abort))
        self._send_pending_aborts()

    def _send_pending_aborts(self) -> None:
        with self.ctx.lock:
            now, keep = time.monotonic(), []
            for item in self._pending_aborts:
                deadline, addr, node, dp_rank, abort = item
                if now > deadline:
                    log.info("%s: room %d: prefill not told of its abort (%s not ready in time)", self.ctx.where,
                             abort.room, node)
                    continue
                link = self.links.link(addr, node, dp_rank, abort.room)
                if link is None or link.state is LinkState.RESOLVING:
                    keep.append(item)
                elif link.state is LinkState.READY:
                    self.tell_prefill(link, abort, f"{self.ctx.where} room {abort.room}")
            self._pending_aborts = keep

    # --- used by the manager ------------------------------------------------------------

    @property
    def num_live(self) -> int:
        """Rooms with a receiver that has not ended."""
        return len(self.receivers)

    def endpoint_of(self, session: str) -> str | None:
        """The control endpoint of a prefill rank of a known link."""
        return self.links.endpoint_of(session)

    def take_acks(self, session: str) -> tuple[int, ...]:
        """A decode rank takes no requests: its pongs acknowledge none."""
        return ()

    def on_pong(self, session: str, acks, pinged_at: float | None) -> None:
        """Prefill rank ``session`` answered a ping sent at ``pinged_at``
        (None: not known), acknowledging the requests ``acks``: the rooms of
        requests sent before that ping and never acknowledged fail now."""
        with self.ctx.lock:
            lost = self.unacked.pong(session, acks, pinged_at)
            self.num_lost_requests += len(lost)
        for receiver, tp_rank in lost:
            receiver.request_lost(tp_rank)

    def live_peers(self, now: float) -> dict[str, str]:
        """Session -> control endpoint of the prefill ranks to watch (called
        under the lock): ranks a live room still awaits (or waits to hear
        have stopped writing), and the ranks of recently used ready links."""
        peers = self.links.watched(now)
        for r in self.receivers.values():
            link = r.link
            if link is not None and link.ranks:
                for p in r.ranks_writing():
                    peers[link.ranks[p].session] = link.ranks[p].control_endpoint
        return peers

    def peer_lost(self, session: str, why: str, *, gone: bool = False) -> None:
        """A prefill rank went silent or is gone (``why``; ``gone``: its address refuses
        connections): forget every link through it (the next room looks the node up afresh)
        and fail the rooms that await it (or, gone before it took their requests, have them
        ask the node afresh: :meth:`KVReceiver.peer_lost`)."""
        with self.ctx.lock:
            self.links.forget_session(session, why)
            receivers = list(self.receivers.values())
        for r in receivers:
            r.peer_lost(session, why, gone=gone)

    def on_message(self, msg, origin: str = "") -> None:
        """A control message from ``origin`` (see :mod:`transfer.control.base`)."""
        if isinstance(msg, ChunkStaged) and self.staging is not None:
            with self.ctx.lock:
                receiver = self.receivers.get((msg.room, msg.request_id))
            self.staging.on_staged(msg, receiver)  # its copy runs without the lock
            return
        with self.ctx.lock:
            if isinstance(msg, PeerBye):
                if origin and self.ctx.config.check_peer_host and not same_host(msg.session, origin):
                    self.num_refused_byes += 1
                    return
                self.links.forget_session(msg.session)  # its live rooms were told by RoomStatus already
                return
            if isinstance(msg, PeerHelloReply):
                self.links.on_hello_reply(msg)
                return
            if isinstance(msg, (RoomStatus, RoomAbort)):
                receiver = self.receivers.get((msg.room, msg.request_id))
                if receiver is not None:
                    receiver.on_message(msg)
                return
            if isinstance(msg, StageRequest) and self.staging is not None:
                self.staging.on_request(msg)
                return
        log.debug("%s: ignored a %s message", self.ctx.where, msg.KIND)

    def expire(self, tick: Callable[[], None] = lambda: None) -> None:
        """Poll the live receivers, so that their timeouts fire (the manager's
        liveness thread, every half second or so); ``tick()`` between two."""
        with self.ctx.lock:
            receivers = list(self.receivers.values())
        for r in receivers:
            r.update()
            tick()

    def live_rooms(self) -> list:
        """The receivers whose pages a write may still land in (under the lock):
        every one not ended (a failing one ends once its writers stopped)."""
        return list(self.receivers.values())

    def close(self, error: BaseException) -> None:
        self.links.close()
        with self.ctx.lock:
            receivers = list(self.receivers.values())
        for r in receivers:
            r.fail(error, drain=False)

    # --- called by the resolver thread ---------------------------------------------------

    def _kick(self, pace: Callable[[], None]) -> None:
        """Advance waiting receivers now, not at their scheduler's next poll,
        so requests reach prefill as soon as the node is resolved;
        ``pace()`` between two (each sends its requests: 64 rooms waiting on
        a new node are milliseconds of the resolver's thread)."""
        with self.ctx.lock:
            waiting = [r for r in self.receivers.values() if r.phase is DecodePhase.BOOTSTRAPPING]
        for r in waiting:
            pace()
            r.update()

    def _tick(self) -> float | None:
        """Pending aborts and quarantined staging regions; the seconds until
        they want another tick (None: nothing pending)."""
        due = None
        if self._pending_aborts:
            self._send_pending_aborts()
            due = 0.0 if self._pending_aborts else None
        if self.staging is not None:
            quarantine = self.staging.pump()  # frees quarantined regions
            if quarantine is not None:
                due = quarantine if due is None else min(due, quarantine)
        return due
