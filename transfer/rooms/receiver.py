"""Decode side: KVReceiver, one per request. Its phases are the table of
:mod:`transfer.rooms.decode_phases`. It takes the room through the first
ones (the link looked up, ``init``'s input, the storage prefetch), routes
what happens to the room to the collaborator of its phase, and fails it. Its
collaborators, one job each: its link to the prefill DP group
(:mod:`transfer.rooms.decode_link`); its transfer, from the requests to
Success, with its one relink (:mod:`transfer.rooms.decode_transfer`); a
failed room's end: drain, restore, Failed
(:mod:`transfer.rooms.decode_ending`); its storage steps: prefetch and
fallback (:mod:`transfer.rooms.decode_storage`, over
:mod:`transfer.rooms.room_storage`); its stats
(:mod:`transfer.rooms.room_stats`). The rank's room table is
:mod:`transfer.rooms.decode_table`, which also scatters staged parts
(:mod:`transfer.rooms.staged_decode`)."""

from __future__ import annotations

import logging
import time
import weakref

from transfer.config import Role
from transfer.errors import KVTimeoutError, PeerError, RequestError, StateError
from transfer.messages import ChunkStaged, RoomAbort, RoomStatus
from transfer.rooms.context import RoomHost
from transfer.rooms.decode_ending import Failure, RoomEnding
from transfer.rooms.decode_link import RoomLink
from transfer.rooms.decode_phases import ENDING, LIVE, DecodePhase, DecodePhases
from transfer.rooms.decode_request import RoomRequest
from transfer.rooms.decode_storage import StorageSteps
from transfer.rooms.decode_transfer import RoomTransfer
from transfer.rooms.links import Link, LinkState
from transfer.rooms.room_stats import RoomCounts
from transfer.rooms.staged_decode import ScatterTarget
from transfer.state import KVPoll
from transfer.stats import FailureReason, RoomStats, tag_reason

log = logging.getLogger("kvferry.receiver")

P = DecodePhase


def _weakly(method):
    """``method`` (a room's bound method) for a collaborator to call back,
    without keeping the room alive: the room holds the collaborator, and a
    strong reference back would make a reference cycle, freed only by a
    garbage collection, which stops every thread for as long as it walks the
    heap. The rank's table holds a live room, so a call reaches it; once the
    room is gone, a late call does nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return call


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
        self.bootstrap_addr = bootstrap_addr
        self.prefill_node = prefill_node or ctx.config.node_id
        self.prefill_dp_rank = prefill_dp_rank
        self._phases = DecodePhases(f"{ctx.where} room {self.room}",
                                   on_change=lambda: ctx.changed(self, self._phases.poll))
        self._created = time.monotonic()
        self._request: RoomRequest | None = None  # the pages, aux slot and state items: from init()
        self._init_at = 0.0
        self._counts = RoomCounts(ctx.stats.room(self.room), ctx.rank, self.where)
        self._prefill = RoomLink(self._table, bootstrap_addr, self.prefill_node, prefill_dp_rank, self.room)
        self._transfer = RoomTransfer(ctx, self._table, self._prefill, self._counts, self._phases)
        # (their calls back to the room hold it weakly: see _weakly)
        self._ending = RoomEnding(self._phases, self._counts, ctx.config, self._prefill,
                                  remove=_weakly(self._remove))
        self._storage = StorageSteps(ctx, self._counts, self._ending, advance=_weakly(self.update))
        with ctx.lock:
            self._table.add(self)
        log.debug("%s: created (prefill node %r)", self.where, self.prefill_node)

    @property
    def request_id(self) -> int:
        """The id of the room's requests to prefill (a new one if it asks the node afresh)."""
        return self._transfer.request_id

    @property
    def pages_from_storage(self) -> int:
        """Pages of this room restored from storage (prefetch and fallback)."""
        return self._storage.pages_loaded

    @property
    def draft_restored(self) -> bool:
        """False when the room succeeded from storage without its draft pages."""
        return self._storage.draft_ok

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
        with the last chunk. A room with state is never restored from
        storage (the tier keeps pages, not state).
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
            if (error := self._storage.open(token_ids, request)) is not None:
                self.fail(error)
                return
        self.update()

    def poll(self) -> KVPoll:
        """The room's state now. Also moves this rank's control messages and
        transfers along on the caller's thread (see ``RoomContext.pump``)."""
        self._ctx.pump()
        return self.update()

    def update(self) -> KVPoll:
        """Advance the room to what it can be now (timeouts included) and
        return its state (the room layer's poll: no pumping)."""
        with self._ctx.lock:
            ph = self._phases
            now = time.monotonic()
            if ph.phase is P.DRAINING:
                self._ending.poll(now, local_writes=self._local_writes())
            if ph.phase not in LIVE:
                return ph.poll
            if ph.phase is P.BOOTSTRAPPING and self._take_link(now):
                ph.move(P.WAITING_FOR_INPUT)
            if ph.phase is P.WAITING_FOR_INPUT and self._request is not None:
                if self._storage.prefetching:
                    ph.move(P.PREFETCHING)
                else:
                    self._fail_if(self._transfer.start(self, self._request))
            if ph.phase is P.PREFETCHING and self._storage.prefetched(now - self._init_at):
                self._fail_if(self._transfer.start(self, self._request))
            if ph.phase is P.RELINKING:
                self._fail_if(self._transfer.relinked(self))
            self._fail_if(self._transfer.overdue(self, now, since=self._init_at))
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
            counter = self._counts.counter
            counter.pages_from_storage = self.pages_from_storage
            wait = self._prefill.handshake_wait(self._created, time.monotonic())
            return counter.snapshot(self._phases.poll.name, handshake_wait_s=wait)

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
                f"{self._transfer.num_scattering} scatter(s) running")

    def ranks_writing(self) -> set[int]:
        """Prefill ranks that may still write into this room's pages."""
        if self._phases.phase in ENDING:
            return set(self._ending.drain.ranks)
        return self._transfer.awaited if self._phases.phase is P.TRANSFERRING else set()

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
        return self._ending.drain.writers_lost

    @property
    def link(self) -> Link | None:
        """The prefill DP group of the room, once looked up."""
        return self._prefill.link

    def on_message(self, msg) -> None:
        """A RoomStatus or RoomAbort for this room (under ``ctx.lock``)."""
        ph = self._phases
        if ph.poll is not KVPoll.Transferring or ph.phase is P.RELINKING:
            return
        if ph.phase not in ENDING:
            self._fail_if(self._transfer.on_report(self, msg))
        elif isinstance(msg, RoomStatus):  # any terminal word from a rank means it writes no more
            self._ending.stopped(msg.prefill_tp_rank, local_writes=self._local_writes())

    def begin_scatter(self, msg: ChunkStaged) -> ScatterTarget | None:
        """Where a staged part from prefill rank ``msg.prefill_tp_rank`` goes;
        None unless the room is transferring. Until :meth:`end_scatter` the
        room cannot end: a failure waits for the copy like a draining rank
        (under ``ctx.lock``)."""
        return self._transfer.begin_scatter(msg)

    def end_scatter(self, msg: ChunkStaged, error: BaseException | None) -> None:
        """A scatter :meth:`begin_scatter` allowed ended (under ``ctx.lock``)."""
        self._fail_if(self._transfer.end_scatter(msg, error))
        if self._phases.phase is P.DRAINING:
            self._ending.write_ended(time.monotonic(), local_writes=self._local_writes())

    def peer_lost(self, session: str, why: str, *, gone: bool = False) -> None:
        """Prefill rank ``session`` went silent or is gone (``why``; ``gone``:
        its address refuses connections, the process is no more)."""
        with self._ctx.lock:
            if self._phases.phase not in LIVE | ENDING:
                return
            lost = self._prefill.ranks_of(session, self.ranks_writing())
            if not lost:
                return
            if gone and self._transfer.may_relink(lost):
                log.info("%s: prefill rank %s of %s (%s) %s before it took the request: looking the node up "
                         "again", self.where, min(lost), self.link.name, session, why)
                self._fail_if(self._transfer.relink(self))
                return
            ending = self._phases.phase in ENDING
            self._ending.ranks_lost(lost, local_writes=self._local_writes())
            if not ending:
                self.fail(tag_reason(PeerError(f"{self.where}: prefill rank {min(lost)} of {self.link.name} "
                                               f"({session}) {why}"), FailureReason.PEER_LOST), stopped=lost)

    def request_lost(self, tp_rank: int) -> None:
        """Prefill rank ``tp_rank`` answered a liveness ping sent after this
        room's request without ever taking the request (see
        :mod:`transfer.rooms.request_acks`): it writes nothing for the room."""
        with self._ctx.lock:
            if self._phases.phase in ENDING:
                self._ending.stopped(tp_rank, local_writes=self._local_writes())
            else:
                self._fail_if(self._transfer.request_lost(tp_rank))

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
            self._storage.fail(fall_back and drain)
            writing = self.ranks_writing() - set(stopped)
            abort = RoomAbort(room=self.room, request_id=self.request_id, reason=str(error), session=ctx.rank.session)
            if notify:
                writing -= self._prefill.tell_abort(abort, self.where)
            self._ending.begin(error, writing, drain=drain, local_writes=self._local_writes())

    # --- internals --------------------------------------------------------------

    def _remove(self) -> None:
        """The room ended: out of the rank's table."""
        self._table.remove(self)

    def _fail_if(self, failure: Failure | None) -> None:
        """Fail the room with what a collaborator found (None: nothing)."""
        if failure is not None:
            self.fail(failure.error, notify=failure.notify, stopped=failure.stopped, fall_back=failure.fall_back)

    def _take_link(self, now: float) -> bool:
        """BOOTSTRAPPING: whether the room's link is ready (then the room's);
        a failed link fails the room, and so does bootstrapping for longer
        than ``bootstrap_timeout_s``."""
        link, timeout_s = self._prefill.take(), self._ctx.config.bootstrap_timeout_s
        if link is not None and link.state is LinkState.FAILED:
            self.fail(link.error)
        elif link is None and now - self._created > timeout_s:
            self.fail(KVTimeoutError(f"{self.where}: {self._prefill.not_ready(timeout_s)}"))
        return link is not None and link.state is LinkState.READY

    def _local_writes(self) -> bool:
        """Whether this rank itself may still write into the pages: a scatter, a prefetch's batch."""
        return bool(self._transfer.num_scattering) or self._storage.loading
