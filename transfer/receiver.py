"""Decode side: KVReceiver, one per request. Its phases are the table of
:mod:`transfer.rooms.decode_phases`; the rank's room table is
:mod:`transfer.rooms.decode_table`."""

from __future__ import annotations

import logging
import random
import time
from typing import TYPE_CHECKING

import numpy as np

from bootstrap.messages import PoolRole
from transfer.config import Role
from transfer.errors import (KVFerryError, KVTimeoutError, PageIndexError, PeerError, ProtocolError, RequestError,
                             StateError, StorageMissError, TransferError)
from transfer.messages import RoomAbort, RoomStatus, Status, TransferRequest
from transfer.pools import host_page_ids
from transfer.rooms.decode_phases import ENDING, LIVE, DecodePhase, DecodePhases
from transfer.rooms.links import Link, LinkState
from transfer.rooms.receiver_restore import ReceiverRestore
from transfer.rooms.room_stats import RoomCounts
from transfer.rooms.room_storage import RoomStorage
from transfer.staging.decode_flow import scatter_part, take_aux_row
from transfer.state import KVPoll
from transfer.stats import FailureReason, RoomStats, tag_reason

if TYPE_CHECKING:
    from transfer.manager import KVManager

log = logging.getLogger("kvferry.receiver")

P = DecodePhase


class KVReceiver(ReceiverRestore):
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

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int, *, prefill_node: str | None = None,
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
        self._pages: np.ndarray | None = None  # decode page ids, request order, and the aux slot: from init()
        self._aux_index, self._init_at = -1, 0.0
        self._awaiting: dict[int, set[PoolRole]] = {}  # TRANSFERRING: ranks not done yet, and their pools
        self._failure: BaseException | None = None  # DRAINING, RESTORING: why the room failed
        self._draining: set[int] = set()  # ranks that may still write
        self._writers_lost = False  # a rank that may write was given up on without its word
        self._drain_deadline = 0.0
        self._storage: RoomStorage | None = None  # with a storage tier and the prompt
        self._prefetch = None  # storage job loading the leading pages before the request goes out
        self._prefix = 0  # leading pages the scheduler holds (init's skip_pages)
        self._skip = 0  # leading pages held or prefetched from storage: prefill does not send them
        self._restore = None  # RESTORING: the storage job loading the pages from ``_skip`` on
        self._may_fall_back = False
        #: pages of this room restored from storage (prefetch and fallback)
        self.pages_from_storage = 0
        #: False when the room succeeded from storage without its draft pages
        self.draft_restored = True
        self._counter = ctx.stats.room(self.room)
        self._counts = RoomCounts(self._counter, ctx.rank, self.where)
        with ctx.lock:
            self._table.add(self)
        log.debug("%s: created (prefill node %r)", self.where, self.prefill_node)

    def init(self, page_indices, aux_index: int | None = None, token_ids=None, skip_pages: int = 0) -> None:
        """The decode pages (in request order) and aux slot to fill.
        ``token_ids`` (the prompt) lets the storage tier prefetch pages it
        has and restore the room if the transfer fails (when the manager has
        a storage tier). ``skip_pages``: leading pages this rank already
        holds, listed but never written; prefill sends from there on (and
        reads it as ``KVSender.decode_prefix_pages``). A storage prefetch
        loads from there on: prefill skips to the larger end of the two."""
        ctx = self._ctx
        with ctx.lock:
            if self._pages is not None:
                raise StateError(f"{self.where}: init() called twice")
            pages = host_page_ids(page_indices)
            target = ctx.rank.pool(PoolRole.TARGET)
            if pages.size and (pages.min() < 0 or pages.max() >= target.num_pages):
                self.fail(PageIndexError(f"{self.where}: page index outside the pool of {target.num_pages}"))
                return
            if not 0 <= int(skip_pages) <= pages.size:
                self.fail(ValueError(f"{self.where}: skip_pages {skip_pages} outside the request's {pages.size} pages"))
                return
            self._pages = pages.astype("<i4")
            self._prefix = self._skip = int(skip_pages)
            self._aux_index = -1 if aux_index is None else int(aux_index)
            self._init_at = time.monotonic()
            if ctx.storage is not None and token_ids is not None:
                try:
                    self._storage = RoomStorage(ctx.storage, token_ids, self._pages, self._aux_index)
                except ValueError as exc:
                    self.fail(RequestError(f"{self.where}: {exc}"))
                    return
                if ctx.config.storage_prefetch != "off":
                    self._prefetch = self._storage.prefetch(self._storage_done, start=self._prefix)
        self.poll()

    def poll(self) -> KVPoll:
        ctx = self._ctx
        with ctx.lock:
            ph = self._phases
            now = time.monotonic()
            if ph.phase is P.DRAINING and now > self._drain_deadline:
                self._writers_lost = True
                log.info("%s: prefill ranks %s did not confirm they stopped writing within %g s",
                         self.where, sorted(self._draining), ctx.config.peer_timeout_s)
                self._finish_fail(self._failure)
            if ph.phase not in LIVE:
                return ph.poll
            if ph.phase is P.BOOTSTRAPPING:
                self._bootstrap(now)
            if ph.phase is P.WAITING_FOR_INPUT and self._pages is not None:
                ph.move(P.PREFETCHING if self._prefetch is not None else P.TRANSFERRING)
                if ph.phase is P.TRANSFERRING:
                    self._send_requests()
            if ph.phase is P.PREFETCHING and self._prefetched(now):
                ph.move(P.TRANSFERRING)
                self._send_requests()
            if ph.phase is P.TRANSFERRING and now - self._init_at > ctx.config.transfer_timeout_s:
                self.fail(KVTimeoutError(
                    f"{self.where}: no completion from prefill ranks {sorted(self._awaiting)} of "
                    f"{self._link.name} within {ctx.config.transfer_timeout_s:g} s"))
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
            return self._counter.snapshot(self._phases.poll.name)

    def ranks_writing(self) -> set[int]:
        """Prefill ranks that may still write into this room's pages."""
        if self._phases.phase in ENDING:
            return set(self._draining)
        return set(self._awaiting) if self._phases.phase is P.TRANSFERRING else set()

    # --- room layer: called by the room table and the staging flow ---------------

    @property
    def where(self) -> str:
        return self._phases.where

    @property
    def phase(self) -> DecodePhase:
        return self._phases.phase

    @property
    def writers_lost(self) -> bool:
        """Whether a rank that may still write was given up on (see :mod:`transfer.staging.arenas`)."""
        return self._writers_lost

    @property
    def link(self) -> Link | None:
        """The prefill DP group of the room, once looked up."""
        return self._link

    def on_message(self, msg) -> None:
        """A RoomStatus or RoomAbort for this room (under ``ctx.lock``)."""
        ph = self._phases
        if ph.poll is not KVPoll.Transferring:
            return
        if ph.phase in ENDING:
            # Any terminal word from a rank means it writes no more.
            if isinstance(msg, RoomStatus):
                self._draining.discard(msg.prefill_tp_rank)
                if not self._draining:
                    self._finish_fail(self._failure)
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
        if msg.aux_row and (bad := take_aux_row(self._ctx, self._aux_index, msg.aux_row)):
            self.fail(ProtocolError(f"{self.where}: {where} {bad}"), stopped={msg.prefill_tp_rank})
            return
        del self._awaiting[msg.prefill_tp_rank]
        p = msg.prefill_tp_rank
        self._counts.rank_done(p, self._link.routes[p], len(self._pages) - self._skip,
                               with_aux=p == self._link.aux_rank and self._aux_index >= 0)
        if not self._awaiting:
            self._counts.ended(None, side="decode", config=self._ctx.config)
            ph.move(P.SUCCESS)
            self._table.remove(self)

    def scatter_part(self, msg, offset: int) -> None:
        """Unpack a staged part from prefill rank ``msg.prefill_tp_rank`` that
        landed at ``offset`` of the staging memory (under ``ctx.lock``)."""
        if self._phases.phase is not P.TRANSFERRING:
            return
        try:
            scatter_part(self._ctx, self._pages, msg, offset, self._link.routes[msg.prefill_tp_rank])
        except Exception as exc:
            self.fail(TransferError(f"{self.where}: scattering staged part {msg.part}: {exc}"))
            return
        self._counts.staged(msg.prefill_tp_rank, self._link.routes[msg.prefill_tp_rank], msg.num_pages)

    def peer_lost(self, session: str, silent_s: float) -> None:
        """Prefill rank ``session`` went silent."""
        with self._ctx.lock:
            link = self._link
            if self._phases.phase not in LIVE | ENDING or link is None or not link.ranks:
                return
            lost = {p for p in self.ranks_writing() if link.ranks[p].session == session}
            if not lost:
                return
            self._writers_lost = True
            if self._phases.phase in ENDING:  # a dead rank writes no more
                self._draining -= lost
                if not self._draining:
                    self._finish_fail(self._failure)
                return
            p = min(lost)
            self.fail(tag_reason(PeerError(f"{self.where}: prefill rank {p} of {link.name} ({session}) silent for "
                                           f"more than {silent_s:g} s: dead, stopped or unreachable"),
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
            if self._prefetch is not None:
                self._prefetch.cancel()
            writing = self.ranks_writing() - set(stopped)
            link = self._link
            abort = RoomAbort(room=self.room, request_id=self.request_id, reason=str(error), session=ctx.rank.session)
            if notify and link is not None and link.ranks:
                writing -= self._table.abort_on_prefill(link, abort, self.where)
            elif notify and link is None:  # not looked up yet: told once it is (a failed lookup has nobody to tell)
                self._table.abort_when_resolved(self.bootstrap_addr, self.prefill_node, self.prefill_dp_rank, abort)
            self._writers_lost |= bool(writing) and not drain
            if writing and drain:
                log.debug("%s failing, waiting for prefill ranks %s to stop writing: %s", self.where,
                          sorted(writing), error)
                self._failure, self._draining = error, writing
                self._drain_deadline = time.monotonic() + ctx.config.peer_timeout_s
                self._phases.move(P.DRAINING)
                return
            self._finish_fail(error)

    # --- internals --------------------------------------------------------------

    def _bootstrap(self, now: float) -> None:
        config = self._ctx.config
        link = self._table.link(self.bootstrap_addr, self.prefill_node, self.prefill_dp_rank, self.room)
        if link is not None and link.state is LinkState.FAILED:
            self._table.forget(link)
            self._link = link
            self.fail(link.error)
            return
        if link is not None and link.state is LinkState.READY:
            self._link = link
            self._phases.move(P.WAITING_FOR_INPUT)
            return
        if now - self._created > config.bootstrap_timeout_s:
            what = link.progress if link is not None else "prefill DP size unknown"
            name = link.name if link is not None else f"prefill node {self.prefill_node!r}"
            self.fail(KVTimeoutError(f"{self.where}: {name} not ready after "
                                     f"{config.bootstrap_timeout_s:g} s: {what}"))

    def _send_requests(self) -> None:
        """Ask each contacted prefill rank for its part (phase TRANSFERRING)."""
        link, rank = self._link, self._ctx.rank
        pages = self._pages.tobytes()
        for p, assignments in link.routes.items():
            self._awaiting[p] = {a.role for a in assignments if a.send}
        try:
            for p, assignments in link.routes.items():
                self._ctx.channel.send(link.ranks[p].control_endpoint, TransferRequest(
                    room=self.room, request_id=self.request_id, decode_session=rank.session,
                    decode_endpoint=rank.control_endpoint, decode_tp_rank=rank.tp_rank,
                    dst_pages=pages, dst_aux_index=self._aux_index if p == link.aux_rank else -1,
                    assignments=assignments, num_requests=link.num_requests[p], skip_pages=self._skip,
                    prefix_pages=self._prefix))
                self._table.request_sent(self, p, link.ranks[p].session)
        except KVFerryError as exc:
            self.fail(exc)

    def request_lost(self, tp_rank: int) -> None:
        """Prefill rank ``tp_rank`` answered a liveness ping sent after this
        room's request without ever taking the request (see
        :mod:`transfer.rooms.request_acks`): it writes nothing for the room."""
        with self._ctx.lock:
            if self._phases.phase in ENDING:
                if tp_rank in self._draining:
                    self._draining.discard(tp_rank)
                    if not self._draining:
                        self._finish_fail(self._failure)
                return
            if self._phases.phase is not P.TRANSFERRING or tp_rank not in self._awaiting:
                return
            self.fail(tag_reason(PeerError(
                f"{self.where}: prefill rank {tp_rank} of {self._link.name} never took this room's request: it "
                "answered a liveness ping sent after it, without it (lost on the way, or dropped by prefill)"),
                FailureReason.REQUEST_LOST), stopped={tp_rank})

