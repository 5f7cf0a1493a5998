"""Prefill side: KVSender, one per request. ``send()`` plans each chunk
(:mod:`transfer.rooms.chunk_plan`), hands the direct jobs to the transport
and the staged parts to the staged flow (:mod:`transfer.rooms.staged_prefill`),
and the pages to the write-through (:mod:`transfer.rooms.write_through`).
Its collaborators, one job each: the decode requests it waits for
(:mod:`transfer.rooms.room_requests`), its send() calls as chunks
(:mod:`transfer.rooms.chunk_sequence`), its writes in flight and what they
landed (:mod:`transfer.rooms.room_writes`), what decode is told when it
ends (:mod:`transfer.rooms.decode_notice`). The rank's room table is
:mod:`transfer.rooms.prefill_table`."""

from __future__ import annotations

import logging
import time

from transfer.config import Role
from transfer.errors import KVFerryError, PageIndexError, PeerError, RequestError, StateError
from transfer.messages import RoomAbort, TransferRequest
from transfer.ready import gate_for
from transfer.rooms.chunk_plan import Chunk, SendingRoom, plan_chunk
from transfer.rooms.chunk_sequence import ChunkSend, ChunkSequence
from transfer.rooms.decode_notice import DecodeNotice
from transfer.rooms.parts import StagedSpec
from transfer.rooms.context import RoomHost
from transfer.rooms.room_requests import RoomRequests
from transfer.rooms.room_stats import RoomCounts
from transfer.rooms.room_writes import RoomWrites
from transfer.rooms.write_through import WriteThrough
from transfer.staging.copies import aux_row
from transfer.state import KVPoll, RoomState
from transfer.stats import FailureReason, RoomStats, tag_reason

log = logging.getLogger("kvferry.sender")


class KVSender:
    """Sends one request's KV from a prefill rank (one per room).

    Lifecycle: create it when the request is scheduled; ``poll()`` says
    ``Bootstrapping`` until every decode rank that expects this room's KV from
    this rank sent its request, then ``WaitingForInput``. Call ``init`` once,
    then ``send`` for each chunk of prefilled pages (the last with
    ``last=True``); the room is ``Transferring`` until the last chunk landed
    and decode was told, then ``Success``. Any failure gives ``Failed``, and
    ``failure_exception()`` raises why. Nothing here blocks.
    """

    def __init__(self, mgr: RoomHost, bootstrap_addr: str | None, bootstrap_room: int) -> None:
        mgr.check_open()
        if mgr.config.role is not Role.PREFILL:
            raise StateError(f"{mgr.where}: a KVSender needs a prefill manager")
        self._ctx = ctx = mgr.context
        self._table = mgr.rooms
        self.room = int(bootstrap_room)
        self._state = RoomState(f"{ctx.where} room {self.room}", on_change=lambda: ctx.changed(self, self._state.state))
        self._created = time.monotonic()
        self._requests = RoomRequests(self._state.where, self._table)
        self._chunks = ChunkSequence(self._state.where, ctx.rank.pools, ctx.config.layerwise_min_tokens)
        self._counts = RoomCounts(ctx.stats.room(self.room), ctx.rank, self._state.where)
        self._writes = RoomWrites(ctx.transport, self._counts, self._created)
        self._notice = DecodeNotice(ctx, self.room, self._state.where, self._table.peers, aux_row)
        log.debug("%s: created", self._state.where)
        for msg in self._table.attach(self):
            self.on_message(msg)

    # --- scheduler API ----------------------------------------------------------

    def init(self, num_pages: int, aux_index: int | None = None, token_ids=None) -> None:
        """Declare the request's total pages and its aux slot on this rank.
        ``token_ids`` (the prompt) lets the storage tier write the sent pages
        through (when the manager has one)."""
        with self._ctx.lock:
            self._chunks.init(num_pages, aux_index)
            tier = self._ctx.storage
            if tier is not None and token_ids is not None and self._ctx.config.storage_write_through:
                self._writes.write_through = WriteThrough(tier, self._ctx.rank,
                                                          tier.chains(token_ids)[:self._chunks.num_pages],
                                                          tier.aux_key(token_ids), self._state.where)
            self._check_sizes()

    def send(self, page_indices, last: bool = False, ready=None, state_indices=None, layers=None) -> None:
        """Queue the next chunk's pages (prefill page ids, in request order:
        a list, a numpy array or a tensor, CPU or CUDA). Allowed in
        WaitingForInput or Transferring, before the last chunk; on a Failed
        room it does nothing. Returns at once; problems with the pages fail
        the room (see ``poll``).

        ``layers``: send only these layers of the chunk (a range or ints over
        the room's layers: the target pool's, then the draft pool's), as the
        forward pass finishes them, each group with its own ``ready`` event;
        call again with the same pages and ``last`` for its other layers, in
        any order (the rule: :mod:`transfer.rooms.chunk_sequence`).
        ``state_indices`` (with the last chunk only): per state pool of the
        manager, in order, the room's item indices (None: none; -1: a
        position this rank no longer holds), sent to the decode ranks that
        ask for that state; item ``i`` goes to decode's item ``i``.

        Precondition: the pages hold their final KV when kvferry reads them.
        With CUDA pools written on a stream other than the one this thread
        synchronised, pass ``ready``: a ``torch.cuda.Event`` recorded on that
        stream after the KV was written (or any object with ``query()`` /
        ``synchronize()``), waited for on kvferry's threads, never here, for
        at most ``transfer_timeout_s`` (then the room fails with
        KVTimeoutError). Without ``ready`` the caller must have synchronised
        (the rule: :mod:`transfer.ready`)."""
        with self._ctx.lock:
            if self._state.state is KVPoll.Failed:
                return
            self._chunks.check_next(self._state.state)
            pages, states = self._chunks.arguments(page_indices, last, state_indices, layers)
            gate = gate_for(ready, self._ctx.config.transfer_timeout_s, self._state.where)
            send = self._chunks.whole(pages, last, states) if layers is None else \
                self._chunks.group(pages, last, layers, states)
            self._notice.forward_sent(gate)
            plan = None if send is None else self._plan(send.chunk, send.states)  # no send: a held layer group
            if plan is not None:
                self._submit(plan, send, gate)

    def _plan(self, chunk: Chunk, states):
        """``chunk`` planned (None: the plan's checks failed the room)."""
        room = SendingRoom(self._state.where, self._ctx.rank, tuple(self._requests), self._table.peers,
                           self._chunks.num_pages, self._chunks.aux_index, states)
        try:
            return plan_chunk(room, chunk, self._ctx.config)
        except (ValueError, IndexError) as exc:  # the plan's checks: page ids, sizes
            kind = PageIndexError if isinstance(exc, IndexError) else RequestError
            self.fail(exc if isinstance(exc, KVFerryError) else kind(f"{self._state.where}: {exc}"))
            return None

    def _submit(self, plan, send: ChunkSend, gate) -> None:
        """Hand a planned chunk (or layer group) to the transport and the
        staged flow; a complete chunk moves the room on (under the lock)."""
        self._chunks.planned(send, plan.next_part)
        self._writes.expect(len(plan.jobs) + len(plan.parts))
        if self._state.state is KVPoll.WaitingForInput:
            self._state.move(KVPoll.Transferring)
        if send.complete:  # queued first: the room's success waits for it
            self._writes.store(send.chunk.pages, send.chunk.offset, self._chunks.aux_index if send.last else None,
                               self._on_storage_done, gate)
        self._writes.submit(plan.jobs, gate, self.on_chunk_done)
        if plan.parts:
            self._writes.staged(self._table.staging.submit(self, plan.parts, ready=gate))

    def poll(self) -> KVPoll:
        """The room's state now. Also moves this rank's control messages and
        transfers along on the caller's thread (see ``RoomContext.pump``)."""
        self._ctx.pump()
        return self.update()

    def update(self) -> KVPoll:
        """Fire the room's timeouts and return its state (the room layer's
        poll: no pumping)."""
        with self._ctx.lock:
            if self._state.state is KVPoll.Failed and self._writes.writing_through:
                return KVPoll.Transferring  # write-through still reads the pages: not free yet
            if self._state.state is KVPoll.Bootstrapping:
                late = self._requests.overdue(time.monotonic(), self._created, self._ctx.config.bootstrap_timeout_s)
                if late is not None:
                    self.fail(late)
            return self._state.state

    def hold(self, until: float) -> None:
        """A decode rank holds this room (``RoomHold``): its requests are
        waited for until ``until`` (monotonic), past ``bootstrap_timeout_s``."""
        with self._ctx.lock:
            self._requests.hold(until)

    @property
    def held_until(self) -> float:
        """Until when (monotonic) a decode rank holds this room; 0: never held."""
        return self._requests.held_until

    def failure_exception(self) -> None:
        """Raise the room's failure (a KVFerryError); no-op unless Failed."""
        if self._state.state is KVPoll.Failed:
            raise self._state.error

    def abort(self, reason: str = "aborted by the prefill scheduler") -> None:
        """Fail the room here and tell the decode ranks (which then do not
        restore it from storage)."""
        self._notice.aborted = True
        self.fail(tag_reason(PeerError(f"{self._state.where}: {reason}"), FailureReason.ABORTED))

    def stats(self) -> RoomStats:
        """What this room moved so far, and when (any time, from any thread)."""
        with self._ctx.lock:
            return self._counts.counter.snapshot(self._state.state.name)

    # --- room layer: called by the room table and the staging flow -------------

    @property
    def where(self) -> str:
        return self._state.where

    @property
    def terminal(self) -> bool:
        return self._state.terminal

    @property
    def created(self) -> float:
        """When the sender was made (``time.monotonic()``): its room's age,
        by which a saturated link and short staging serve the oldest room first."""
        return self._created

    @property
    def decode_prefix_pages(self) -> int:
        """The leading pages of the request that decode already holds
        (``KVReceiver.init(skip_pages=)``): prefill sends the pages from
        there on, so ``init``'s page count includes them and the first chunk
        starts with that many entries that are never read. Known once every
        decode request arrived (``poll()`` left Bootstrapping); raises
        StateError before, or when the decode ranks of the room said
        different numbers."""
        with self._ctx.lock:
            return self._requests.prefix_pages()

    @property
    def requests(self) -> tuple[TransferRequest, ...]:
        """The decode requests that arrived for this room."""
        return tuple(self._requests)

    @property
    def awaiting_requests(self) -> bool:
        """Whether the room still waits for decode requests."""
        return self._requests.awaiting

    def on_message(self, msg) -> None:
        """A TransferRequest or RoomAbort for this room."""
        with self._ctx.lock:
            if self._state.terminal:
                return
            if isinstance(msg, RoomAbort):
                if self._requests.aborted_by(msg):
                    self.fail(tag_reason(PeerError(f"{self._state.where}: decode aborted the room: {msg.reason} "
                                                   f"[prefill then: {self.progress()}]"), FailureReason.ABORTED))
                return
            if self._requests.take(msg):
                log.debug("%s: requested by %d decode rank(s)", self._state.where, msg.num_requests)
                self._state.move(KVPoll.WaitingForInput)
                self._check_sizes()

    def on_chunk_done(self, error, moved=()) -> None:
        """A transport job or staged part of this room ended (``error`` None:
        it landed); called once per job or part submitted. ``moved``: the
        job's (pool, path, bytes, descriptors), counted when it landed."""
        with self._ctx.lock:
            self._writes.ended(error, moved)
            if self._state.state is KVPoll.Failed:
                self._tell_failure_when_drained()
                return
            if error is not None:
                self.fail(error)
                return
            if self._state.terminal or not self._chunks.last_sent or self._writes.num_inflight:
                return
            try:
                self._notice.succeed(self._requests, self._chunks.aux_index)
            except Exception as exc:
                self.fail(exc)
                return
            if not self._writes.writing_through:  # else when the write-through is done
                self._succeed()

    def release(self, error: BaseException) -> None:
        """The scheduler releases the KV memory (``KVManager.release_memory``): fail the room."""
        self.fail(error)

    def released(self) -> bool:
        """Whether nothing of this room reads the pools any more: ended, no
        write in flight, no write-through (``KVManager.release_memory``)."""
        with self._ctx.lock:
            return self._state.terminal and self._writes.idle

    def progress(self) -> str:
        """Where the room stands, for a failure's message (under the lock):
        what a reader at 3 a.m. needs to tell a lost message from a stuck write."""
        return (f"{self._state.state.name}, {len(self._requests)} decode request(s), "
                f"{'last chunk sent' if self._chunks.last_sent else 'last chunk not sent'}, "
                + self._writes.describe(self._table.staging))

    def on_part_landed(self, spec: StagedSpec) -> None:
        """A staged part's write landed (before ``on_chunk_done``)."""
        with self._ctx.lock:
            self._writes.part_landed(spec)

    def fail(self, error: BaseException, *, notify: bool = True) -> None:
        """Fail the room, stop submitting its writes, and tell decode once
        none is in flight any more (decode then knows its pages are free)."""
        with self._ctx.lock:
            if not self._state.fail(error):
                return
            self._counts.ended(error, side="prefill", config=self._ctx.config, peer=self._requests.peers())
            self._writes.cancel()  # a write-through goes on: its pages are valid KV whatever the transfer did
            self._table.detach(self, self._requests.ids())
            if self._requests.awaiting:
                self._table.refuse_later(self.room, str(error))
            self._notice.fail_later(str(error) if notify else None)
            if self._table.staging is not None:
                self._table.staging.release(self)
            self._tell_failure_when_drained()

    # --- internals --------------------------------------------------------------

    def _on_storage_done(self, job) -> None:
        """A write-through job ended (on the tier's thread)."""
        with self._ctx.lock:
            self._writes.settle(job)
            if self._state.state is KVPoll.Transferring and self._notice.told_success \
                    and not self._writes.writing_through:
                self._succeed()
            elif self._state.terminal:
                self._ctx.changed(self, self._state.state)  # poll() may now report it

    def _succeed(self) -> None:
        self._counts.ended(None, side="prefill", config=self._ctx.config)
        self._state.move(KVPoll.Success)
        self._table.detach(self, self._requests.ids())

    def _check_sizes(self) -> None:
        if self._chunks.num_pages is not None:
            for error in self._requests.size_errors(self._chunks.num_pages):
                self.fail(error)

    def _tell_failure_when_drained(self) -> None:
        if self._writes.num_inflight <= 0:
            self._notice.tell_failure(self._requests)
