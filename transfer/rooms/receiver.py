"""Decode side: KVReceiver, one per request. Its phases are the table of
:mod:`transfer.rooms.decode_phases`; a failing room's drain is
:mod:`transfer.rooms.drain`, its use of the storage tier (prefetch, restore)
:mod:`transfer.rooms.room_storage`; the rank's room table is
:mod:`transfer.rooms.decode_table`, which also scatters staged parts
(:mod:`transfer.rooms.staged_decode`)."""

from __future__ import annotations

import logging
import random
import time

from bootstrap.messages import PoolRole
from transfer.config import Role
from transfer.errors import (KVFerryError, KVTimeoutError, PeerError, ProtocolError, RequestError,
                             StateError, StorageMissError, TransferError)
from transfer.messages import ChunkStaged, RoomAbort, RoomStatus, Status
from transfer.rooms.context import RoomHost
from transfer.rooms.decode_phases import ENDING, LIVE, DecodePhase, DecodePhases
from transfer.rooms.decode_request import RoomRequest
from transfer.rooms.drain import Drain
from transfer.rooms.links import Link, LinkState
from transfer.rooms.room_stats import RoomCounts
from transfer.rooms.room_storage import RoomStorage
from transfer.rooms.staged_decode import ScatterTarget, count_scattered, take_aux_row
from transfer.state import KVPoll
from transfer.stats import FailureReason, RoomStats, tag_reason

log = logging.getLogger("kvferry.receiver")

P = DecodePhase
# Phases bounded by transfer_timeout_s from init().
_TIMED = frozenset({P.TRANSFERRING, P.RELINKING})


class KVReceiver:
    """Receives one request's KV on a decode rank (one per room).

    Create it when the request arrives with its bootstrap address and room;
    ``poll()`` says ``Bootstrapping`` while the prefill node is looked up and
    handshaken, then ``WaitingForInput``. Call ``init(page_indices,
    aux_index)`` with the pages allocated for the request (it may come earlier;
    it then takes effect when bootstrapping is done); the room is
    ``Transferring`` until every contacted prefill rank reported that its part
    landed, then ``Success``. ``Failed`` otherwise, with
    ``failure_exception()`` raising why. Bounded: ``bootstrap_timeout_s`` in
    Bootstrapping, ``transfer_timeout_s`` from ``init`` to Success. Nothing
    here blocks.

    A room that fails (``abort()``, a timeout, a prefill rank's failure) while
    prefill ranks may still be writing into its pages tells them to stop and
    stays ``Transferring`` until each confirmed it stopped, or was found
    dead, or ``peer_timeout_s`` passed; only then is it ``Failed``, so the
    scheduler may reuse the pages as soon as it sees ``Failed``.

    ``prefill_dp_rank`` names the prefill DP group; None routes the room to
    ``room % dp_size``.
    """

    def __init__(self, mgr: RoomHost, bootstrap_addr: str, bootstrap_room: int, *, prefill_node: str | None = None,
                 prefill_dp_rank: int | None = None) -> None:
        mgr.check_open()
        if mgr.config.role is not Role.DECODE:
            raise StateError(f"{mgr.where}: a KVReceiver needs a decode manager")
        self._ctx = ctx = mgr.context
        self._table = mgr.rooms
        self.room = int(bootstrap_room)
        self.request_id = random.getrandbits(63) | 1
        self.bootstrap_addr = bootstrap_addr
        self.prefill_node = prefill_node or ctx.config.node_id
        self.prefill_dp_rank = prefill_dp_rank
        self._phases = DecodePhases(f"{ctx.where} room {self.room}",
                                   on_change=lambda: ctx.changed(self, self._phases.poll))
        self._created = time.monotonic()
        self._link: Link | None = None
        self._seen_link: Link | None = None  # the link bootstrapping looked at last (it may be waiting)
        self._request: RoomRequest | None = None  # the pages, aux slot and state items: from init()
        self._init_at = 0.0
        self._requested_at = 0.0  # when the requests went to prefill (TRANSFERRING)
        self._awaiting: dict[int, set[PoolRole]] = {}  # TRANSFERRING: ranks not done yet, and their pools
        self._drain = Drain()  # DRAINING: ranks that may still write; DRAINING, RESTORING: why it failed
        self._scattering = 0  # staged parts being copied into the pages now (without the lock)
        self._send_end = 0.0  # the latest prefill rank's forward end, on this clock (0: not known)
        self._storage: RoomStorage | None = None  # with a storage tier and the prompt
        self._may_fall_back = False
        self._relinks = 0  # times the room asked the node afresh (RELINKING)
        self._counter = ctx.stats.room(self.room)
        self._counts = RoomCounts(self._counter, ctx.rank, self.where)
        with ctx.lock:
            self._table.add(self)
        log.debug("%s: created (prefill node %r)", self.where, self.prefill_node)

    @property
    def pages_from_storage(self) -> int:
        """Pages of this room restored from storage (prefetch and fallback)."""
        return self._storage.pages_loaded if self._storage is not None else 0

    @property
    def draft_restored(self) -> bool:
        """False when the room succeeded from storage without its draft pages."""
        return self._storage is None or self._storage.draft_ok

    @property
    def created(self) -> float:
        """When the receiver was made (``time.monotonic()``): its room's age,
        by which decode grants staging oldest room first."""
        return self._created

    def init(self, page_indices, aux_index: int | None = None, token_ids=None, skip_pages: int = 0,
             state_indices=None) -> None:
        """The decode pages (in request order) and aux slot to fill.
        ``state_indices``: per state pool of the manager (in order), the
        item indices to fill (a list, array or tensor; None: not this one;
        a negative index: a position not wanted, e.g. a sliding window's
        blocks before the window), each from the prefill rank that holds it,
        with the last chunk. A
        room with state is never restored from storage (the tier keeps
        pages, not state).
        ``token_ids`` (the prompt) lets the storage tier prefetch pages it
        has and restore the room if the transfer fails (when the manager has
        a storage tier). ``skip_pages``: leading pages this rank already
        holds, listed but never written; prefill sends from there on (and
        reads it as ``KVSender.decode_prefix_pages``). A storage prefetch
        loads from there on: prefill skips to the larger end of the two."""
        ctx = self._ctx
        with ctx.lock:
            if self._request is not None:
                raise StateError(f"{self.where}: init() called twice")
            try:
                request = RoomRequest.checked(ctx.rank, self.where, page_indices, aux_index, skip_pages,
                                              state_indices)
            except RequestError as exc:
                self.fail(exc)
                return
            self._request, self._init_at = request, time.monotonic()
            if ctx.storage is not None and token_ids is not None and not request.has_state:
                try:
                    self._storage = RoomStorage(ctx.storage, token_ids, request, self._counts)
                except ValueError as exc:
                    self.fail(RequestError(f"{self.where}: {exc}"))
                    return
                if ctx.config.storage_prefetch != "off":
                    self._storage.prefetch(self._storage_done)
        self.update()

    def poll(self) -> KVPoll:
        """The room's state now. Also moves this rank's control messages and
        transfers along on the caller's thread (see ``RoomContext.pump``)."""
        self._ctx.pump()
        return self.update()

    def update(self) -> KVPoll:
        """Advance the room to what it can be now (timeouts included) and
        return its state (the room layer's poll: no pumping)."""
        ctx = self._ctx
        with ctx.lock:
            ph = self._phases
            now = time.monotonic()
            if ph.phase is P.DRAINING and not self._local_writes() and self._drain.overdue(now):
                log.info("%s: prefill ranks %s did not confirm they stopped writing within %g s",
                         self.where, sorted(self._drain.ranks), ctx.config.peer_timeout_s)
                self._finish_fail(self._drain.error)
            elif ph.phase is P.DRAINING and not self._local_writes() and not self._drain.ranks:
                self._finish_fail(self._drain.error)  # the last local write (a storage prefetch) ended
            if ph.phase not in LIVE:
                return ph.poll
            if ph.phase is P.BOOTSTRAPPING:
                self._bootstrap(now)
            if ph.phase is P.WAITING_FOR_INPUT and self._request is not None:
                ph.move(P.PREFETCHING if self._storage is not None and self._storage.prefetching
                        else P.TRANSFERRING)
                if ph.phase is P.TRANSFERRING:
                    self._send_requests()
            if ph.phase is P.PREFETCHING and self._storage.prefetched(now - self._init_at, ctx.config):
                ctx.stats.prefetch_wait_seconds.observe(now - self._init_at)
                ph.move(P.TRANSFERRING)
                self._send_requests()
            if ph.phase is P.RELINKING:
                self._relinked()
            if ph.phase in _TIMED and now - self._init_at > ctx.config.transfer_timeout_s:
                self.fail(KVTimeoutError(
                    f"{self.where}: no completion from prefill ranks {sorted(self._awaiting)} of "
                    f"{(self._link or self._seen_link).name} within {ctx.config.transfer_timeout_s:g} s "
                    f"[{self._counter.total_bytes} bytes landed, {self._scattering} scatter(s) running, "
                    f"requests sent {now - self._requested_at:.1f} s ago"
                    + (f"; {self._table.staging.describe(self.room, self.request_id)}"
                       if self._table.staging is not None else "") + "]"))
            return ph.poll

    def failure_exception(self) -> None:
        """Raise the room's failure (a KVFerryError); no-op unless Failed."""
        if self._phases.phase is P.FAILED:
            raise self._phases.error

    def abort(self, reason: str = "aborted by the decode scheduler") -> None:
        """Fail the room here and tell the prefill ranks (no storage fallback)."""
        self.fail(tag_reason(PeerError(f"{self.where}: {reason}"), FailureReason.ABORTED), fall_back=False)

    def stats(self) -> RoomStats:
        """What this room received so far, and when (any time, from any thread)."""
        with self._ctx.lock:
            self._counter.pages_from_storage = self.pages_from_storage
            link = self._link or self._seen_link
            wait = link.handshake_wait(self._created, time.monotonic()) if link is not None else 0.0
            return self._counter.snapshot(self._phases.poll.name, handshake_wait_s=wait)

    def release(self, error: BaseException) -> None:
        """The scheduler releases the KV memory (``KVManager.release_memory``):
        fail the room, tell the prefill ranks, no storage fallback (it would
        write into the pages)."""
        self.fail(error, fall_back=False)

    def released(self) -> bool:
        """Whether no write may land in this room's pages any more: it ended
        (Failed only once its prefill ranks and its own scatters and storage
        prefetch stopped writing)."""
        self.update()
        with self._ctx.lock:
            return self._phases.phase not in LIVE | ENDING and not self._local_writes()

    def progress(self) -> str:
        """Where the room stands, for a failure's message (under the lock)."""
        return (f"{self._phases.phase.name}, prefill ranks {sorted(self.ranks_writing())} may still write, "
                f"{self._scattering} scatter(s) running")

    def ranks_writing(self) -> set[int]:
        """Prefill ranks that may still write into this room's pages."""
        if self._phases.phase in ENDING:
            return set(self._drain.ranks)
        return set(self._awaiting) if self._phases.phase is P.TRANSFERRING else set()

    # --- room layer: called by the room table ------------------------------------

    @property
    def where(self) -> str:
        return self._phases.where

    @property
    def phase(self) -> DecodePhase:
        return self._phases.phase

    @property
    def writers_lost(self) -> bool:
        """Whether a rank that may still write was given up on (see :mod:`transfer.staging.arenas`)."""
        return self._drain.writers_lost

    @property
    def link(self) -> Link | None:
        """The prefill DP group of the room, once looked up."""
        return self._link

    def on_message(self, msg) -> None:
        """A RoomStatus or RoomAbort for this room (under ``ctx.lock``)."""
        ph = self._phases
        if ph.poll is not KVPoll.Transferring or ph.phase is P.RELINKING:
            return
        if ph.phase in ENDING:
            # Any terminal word from a rank means it writes no more.
            if isinstance(msg, RoomStatus):
                self._stopped_writing(msg.prefill_tp_rank)
            return
        if isinstance(msg, RoomAbort):
            self.fail(tag_reason(PeerError(f"{self.where}: prefill aborted the room: {msg.reason}"),
                                 FailureReason.ABORTED), notify=False)
            return
        where = f"prefill rank {msg.prefill_tp_rank} of {self._link.name}"
        if msg.status is Status.FAILED:
            error = PeerError(f"{self.where}: {where} failed: {msg.reason}")
            self.fail(tag_reason(error, FailureReason.ABORTED) if msg.aborted else error,
                      stopped={msg.prefill_tp_rank}, fall_back=not msg.aborted)
            return
        expected = self._awaiting.get(msg.prefill_tp_rank)
        if expected is None:
            return  # a duplicate or a rank we did not ask
        if set(msg.sent) != expected:
            self.fail(ProtocolError(f"{self.where}: {where} sent pools "
                                    f"{sorted(r.value for r in msg.sent)}, expected {sorted(r.value for r in expected)}"),
                      stopped={msg.prefill_tp_rank})
            return
        if msg.aux_row and (bad := take_aux_row(self._ctx, self._request.aux_index, msg.aux_row)):
            self.fail(ProtocolError(f"{self.where}: {where} {bad}"), stopped={msg.prefill_tp_rank})
            return
        del self._awaiting[msg.prefill_tp_rank]
        if msg.exposed_s > 0:  # when the rank's forward ended, on this clock (the message's flight not counted)
            self._send_end = max(self._send_end, time.monotonic() - msg.exposed_s)
        p = msg.prefill_tp_rank
        self._counts.rank_done(p, self._link.routes[p], self._request.num_sent,
                               with_aux=p == self._link.aux_rank and self._request.aux_index >= 0)
        if not self._awaiting:
            if self._send_end > 0:
                self._counter.exposed(time.monotonic() - self._send_end)
            self._counts.ended(None, side="decode", config=self._ctx.config)
            ph.move(P.SUCCESS)
            self._table.remove(self)

    def begin_scatter(self, msg: ChunkStaged) -> ScatterTarget | None:
        """Where a staged part from prefill rank ``msg.prefill_tp_rank`` goes;
        None unless the room is transferring. Until :meth:`end_scatter` the
        room cannot end: a failure waits for the copy like a draining rank
        (under ``ctx.lock``)."""
        if self._phases.phase is not P.TRANSFERRING or msg.prefill_tp_rank not in self._link.routes:
            return None
        self._scattering += 1
        p = msg.prefill_tp_rank
        return ScatterTarget(self._request.pages, self._link.routes[p], self._request.states, self._link.ranks[p])

    def end_scatter(self, msg: ChunkStaged, error: BaseException | None) -> None:
        """A scatter :meth:`begin_scatter` allowed ended (under ``ctx.lock``)."""
        self._scattering -= 1
        if error is not None:
            self.fail(TransferError(f"{self.where}: scattering staged part {msg.part}: {error}"))
        elif self._phases.phase is P.TRANSFERRING:
            count_scattered(self._ctx, self._counts, msg, self._link.routes[msg.prefill_tp_rank])
        if self._phases.phase is P.DRAINING and not self._local_writes() and \
                (not self._drain.ranks or self._drain.overdue(time.monotonic())):
            self._finish_fail(self._drain.error)

    def peer_lost(self, session: str, why: str, *, gone: bool = False) -> None:
        """Prefill rank ``session`` went silent or is gone (``why``; ``gone``:
        its address refuses connections, the process is no more)."""
        with self._ctx.lock:
            link = self._link
            if self._phases.phase not in LIVE | ENDING or link is None or not link.ranks:
                return
            lost = {p for p in self.ranks_writing() if link.ranks[p].session == session}
            if not lost:
                return
            if gone and self._may_relink(lost):
                log.info("%s: prefill rank %s of %s (%s) %s before it took the request: looking the node up "
                         "again", self.where, min(lost), link.name, session, why)
                self._relink()
                return
            self._drain.writers_lost = True
            if self._phases.phase in ENDING:  # a dead rank writes no more
                for p in lost:
                    self._stopped_writing(p, lost=True)
                return
            p = min(lost)
            self.fail(tag_reason(PeerError(f"{self.where}: prefill rank {p} of {link.name} ({session}) {why}"),
                                 FailureReason.PEER_LOST), stopped=lost)

    def fail(self, error: BaseException, *, notify: bool = True, stopped=(), drain: bool = True,
             fall_back: bool = True) -> None:
        """Fail the room: tell the prefill ranks (unless ``notify`` is False),
        and once every rank that may still write has stopped (``stopped``:
        ranks known to have stopped already; ``drain`` False: at once, for a
        closing manager), restore it from storage if it can (``fall_back``),
        or report Failed."""
        ctx = self._ctx
        with ctx.lock:
            if self._phases.phase not in LIVE:
                return
            self._may_fall_back = fall_back and drain and ctx.config.storage_fallback and self._storage is not None
            if self._storage is not None:
                self._storage.cancel_prefetch()
            writing = self.ranks_writing() - set(stopped)
            link = self._link
            abort = RoomAbort(room=self.room, request_id=self.request_id, reason=str(error), session=ctx.rank.session)
            if notify and link is not None and link.ranks:
                writing -= self._table.tell_prefill(link, abort, self.where)
            elif notify and link is None:  # not looked up yet: told once it is (a failed lookup has nobody to tell)
                self._table.abort_when_resolved(self.bootstrap_addr, self.prefill_node, self.prefill_dp_rank, abort)
            self._drain.writers_lost |= bool(writing) and not drain
            if (writing or self._local_writes()) and drain:  # a scatter or a prefetch batch: wait for it too
                log.debug("%s failing, waiting for prefill ranks %s to stop writing: %s", self.where,
                          sorted(writing), error)
                self._drain.start(error, writing, time.monotonic() + ctx.config.peer_timeout_s)
                self._phases.move(P.DRAINING)
                return
            self._finish_fail(error)

    # --- internals --------------------------------------------------------------

    def _bootstrap(self, now: float) -> None:
        config = self._ctx.config
        if self._take_link() is not None:
            self._phases.move(P.WAITING_FOR_INPUT)
            return
        link = self._seen_link
        if self._link is None and now - self._created > config.bootstrap_timeout_s:  # not failed with its link
            what = link.progress if link is not None else "prefill DP size unknown"
            name = link.name if link is not None else f"prefill node {self.prefill_node!r}"
            self.fail(KVTimeoutError(f"{self.where}: {name} not ready after "
                                     f"{config.bootstrap_timeout_s:g} s: {what}"))

    def _may_relink(self, lost: set[int]) -> bool:
        """Whether the room may ask the node afresh, its ranks ``lost`` being
        gone: it never did (once per room), every rank it asked is among them,
        none acknowledged the request or sent a word or a byte for it (a
        killed node restarted between its last room and this one: the new
        process registered, the old link was not yet found dead)."""
        return (self._phases.phase is P.TRANSFERRING and not self._relinks and set(self._link.routes) <= lost
                and set(self._awaiting) == set(self._link.routes) and not self._scattering
                and self._counter.total_bytes == 0
                and all(self._table.unacked.pending(self._link.ranks[p].session, self.request_id)
                        for p in self._link.routes))

    def _relink(self) -> None:
        """Drop the dead link's request (its staging grant retired with it) and
        wait in RELINKING for the node's link afresh, under a new request id."""
        self._relinks += 1
        self._ctx.stats.num_relinked += 1
        self._table.remove(self, writers_lost=True)  # the dead writer's staging regions are retired, not reused
        self.request_id = random.getrandbits(63) | 1
        self._link, self._awaiting = None, {}
        self._phases.move(P.RELINKING)
        self._table.add(self)
        self._relinked()

    def _relinked(self) -> None:
        """RELINKING: once the node's new link is ready, send the requests."""
        if self._take_link() is not None:
            self._phases.move(P.TRANSFERRING)
            self._send_requests()

    def _take_link(self) -> Link | None:
        """The room's link once it is ready (taken as the room's); a failed
        one is forgotten and fails the room (taken too: None returned)."""
        link = self._table.link(self.bootstrap_addr, self.prefill_node, self.prefill_dp_rank, self.room)
        self._seen_link = link
        if link is not None and link.state is LinkState.FAILED:
            self._table.forget(link)
            self._link = link
            self.fail(link.error)
            return None
        if link is not None and link.state is LinkState.READY:
            self._link = link
            return link
        return None

    def _send_requests(self) -> None:
        """Ask each contacted prefill rank for its part (phase TRANSFERRING)."""
        link, request = self._link, self._request
        self._requested_at = time.monotonic()
        for p, assignments in link.routes.items():
            self._awaiting[p] = {a.role for a in assignments if a.send}
        try:
            for p, assignments in link.routes.items():
                staging = self._table.pregrant(self, p, assignments, request.num_sent)
                self._ctx.channel.send(link.ranks[p].control_endpoint, request.message(
                    link, p, self._ctx.rank, self.room, self.request_id, staging))
                self._table.request_sent(self, p, link.ranks[p].session)
        except KVFerryError as exc:
            self.fail(exc)

    def request_lost(self, tp_rank: int) -> None:
        """Prefill rank ``tp_rank`` answered a liveness ping sent after this
        room's request without ever taking the request (see
        :mod:`transfer.rooms.request_acks`): it writes nothing for the room."""
        with self._ctx.lock:
            if self._phases.phase in ENDING:
                self._stopped_writing(tp_rank)
                return
            if self._phases.phase is not P.TRANSFERRING or tp_rank not in self._awaiting:
                return
            self.fail(tag_reason(PeerError(
                f"{self.where}: prefill rank {tp_rank} of {self._link.name} never took this room's request: it "
                "answered a liveness ping sent after it, without it (lost on the way, or dropped by prefill)"),
                FailureReason.REQUEST_LOST), stopped={tp_rank})

    def _stopped_writing(self, tp_rank: int, *, lost: bool = False) -> None:
        """A draining room's prefill rank writes no more (``lost``: it was
        found dead, not told)."""
        if tp_rank in self._drain.ranks and self._drain.stopped(tp_rank, lost=lost) and not self._local_writes():
            self._finish_fail(self._drain.error)

    def _local_writes(self) -> bool:
        """Whether this rank itself may still write into the room's pages: a
        staged part being scattered, or a storage prefetch's batch (under the lock)."""
        return bool(self._scattering) or (self._storage is not None and self._storage.loading)

    # --- the end: storage, restore, failure ----------------------------------------

    def _storage_done(self, job) -> None:
        """A storage job ended (on the tier's thread)."""
        if self._storage.is_restore(job):
            self._restore_done(job)
        else:
            self.update()  # a settled prefetch lets the request go out now

    def _finish_fail(self, error: BaseException) -> None:
        """Nothing writes into the pages any more: restore them from storage,
        or fail."""
        if self._phases.phase not in LIVE | {P.DRAINING}:
            return
        if self._may_fall_back:
            log.debug("%s: transfer failed (%s); restoring the room from storage", self.where, error)
            self._drain.error = error
            self._phases.move(P.RESTORING)
            self._storage.restore(self._storage_done)
            return
        self._really_fail(error)

    def _restore_done(self, job) -> None:
        with self._ctx.lock:
            if self._phases.phase is not P.RESTORING:
                return
            error = self._drain.error
            missing = self._storage.restored(job, allow_missing_draft=self._ctx.config.allow_missing_draft,
                                             where=self.where)
            if missing:
                self._really_fail(StorageMissError(f"{error}; restoring from storage failed: {'; '.join(missing)}"))
                return
            self._counts.ended(None, side="decode", config=self._ctx.config)
            log.warning("%s: restored from storage after: %s", self.where, error)
            self._phases.move(P.SUCCESS)
            self._table.remove(self)

    def _really_fail(self, error: BaseException) -> None:
        if not self._phases.fail(error):
            return
        self._table.remove(self)
        link = self._link
        peer = ",".join(sorted({link.ranks[p].session for p in link.routes if p in link.ranks})) \
            if link is not None and link.ranks \
            else f"{self.prefill_node}/dp{'?' if self.prefill_dp_rank is None else self.prefill_dp_rank}"
        self._counts.ended(error, side="decode", config=self._ctx.config, peer=peer)
