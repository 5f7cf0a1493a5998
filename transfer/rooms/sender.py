"""Prefill side: KVSender, one per request. ``send()`` plans each chunk
(:mod:`transfer.rooms.chunk_plan`), hands the direct jobs to the transport
and the staged parts to the staged flow (:mod:`transfer.rooms.staged_prefill`),
and the pages to the write-through (:mod:`transfer.rooms.write_through`).
The rank's room table is :mod:`transfer.rooms.prefill_table`."""

from __future__ import annotations

import logging
import time

from transfer.config import Role
from transfer.errors import KVFerryError, KVTimeoutError, PageIndexError, PeerError, RequestError, StateError
from transfer.messages import RoomAbort, RoomStatus, Status, TransferRequest
from transfer.pools import host_page_ids
from transfer.ready import gate_for
from transfer.rooms.chunk_plan import Chunk, SendingRoom, plan_chunk
from transfer.rooms.layer_groups import ChunkGroups, by_pool, layer_spans, num_layers, parse_layers
from transfer.rooms.parts import StagedSpec
from transfer.rooms.context import RoomHost
from transfer.rooms.room_stats import RoomCounts
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
        self._held_until = 0.0  # decode holds the room until then (RoomHold): its requests may come later
        self._requests: list[TransferRequest] = []
        self._num_pages: int | None = None
        self._aux_index: int | None = None
        self._offset = 0
        self._last_sent = False
        self._groups: ChunkGroups | None = None  # the chunk whose layer groups are being sent (layer-wise)
        self._num_inflight = 0
        self._last_send_at: float | None = None  # the last send() call (the end of the scheduler's forward)
        self._last_gate = None  # its ready gate: with an event, the forward ends when the event completes
        self._next_part = 0
        self._jobs: list = []  # transport handles, cancelled if the room fails
        self._parts: list = []  # staged parts (transfer.rooms.staged_prefill.StagedPart), for progress()
        self._failure_note: str | None = None  # to send decode once nothing is in flight
        self._write_through: WriteThrough | None = None  # with a storage tier and the prompt
        self._decode_told = False
        self._aborted = False  # by this side's scheduler
        self._counter = ctx.stats.room(self.room)
        self._counts = RoomCounts(self._counter, ctx.rank, self._state.where)
        log.debug("%s: created", self._state.where)
        for msg in self._table.attach(self):
            self.on_message(msg)

    # --- scheduler API ----------------------------------------------------------

    def init(self, num_pages: int, aux_index: int | None = None, token_ids=None) -> None:
        """Declare the request's total pages and its aux slot on this rank.
        ``token_ids`` (the prompt) lets the storage tier write the sent pages
        through (when the manager has one)."""
        with self._ctx.lock:
            if self._num_pages is not None:
                raise StateError(f"{self._state.where}: init() called twice")
            self._num_pages, self._aux_index = int(num_pages), aux_index
            tier = self._ctx.storage
            if tier is not None and token_ids is not None and self._ctx.config.storage_write_through:
                self._write_through = WriteThrough(tier, self._ctx.rank, tier.chains(token_ids)[:self._num_pages],
                                                   tier.aux_key(token_ids), self._state.where)
            self._check_sizes()

    def send(self, page_indices, last: bool = False, ready=None, state_indices=None, layers=None) -> None:
        """Queue the next chunk's pages (prefill page ids, in request order:
        a list, a numpy array or a tensor, CPU or CUDA).

        ``layers`` (layer-wise sends, :mod:`transfer.rooms.layer_groups`):
        send only these layers of the chunk (a range or ints over the room's
        layers: the target pool's, then the draft pool's), as the forward
        pass finishes them, each group with its own ``ready`` event. Call
        again with the same pages and ``last`` for the chunk's other layers,
        in any order; the chunk is complete when every layer was sent, and
        the room moves on to its next chunk only then. A decode rank that
        takes the chunk through staging (a fenced one) gets each group's
        share of each staged part as a part of its own, and scatters it as
        it lands. ``state_indices``
        (with the last chunk only): per state pool of the manager, in order,
        the room's item indices (None: none; -1: a position this rank no
        longer holds), sent to the decode ranks that ask for that state; item
        ``i`` goes to decode's item ``i``. Allowed in
        WaitingForInput or Transferring, before the last chunk; on a Failed
        room it does nothing. Returns at once; problems with the pages fail
        the room (see ``poll``).

        Precondition: the pages hold their final KV when kvferry reads them.
        With CUDA pools written on a stream other than the one this thread
        synchronised, pass ``ready``: a ``torch.cuda.Event`` recorded on that
        stream after the KV was written (or any object with ``query()`` /
        ``synchronize()``). The transport, the staging gather and the
        storage write-through read the chunk only once it completed; they
        wait on their own threads, never here, for at most
        ``transfer_timeout_s`` (then the room fails with KVTimeoutError).
        Without ``ready`` the caller must have synchronised (see
        :mod:`transfer.ready`)."""
        with self._ctx.lock:
            if self._state.state is KVPoll.Failed:
                return
            if self._num_pages is None:
                raise StateError(f"{self._state.where}: send() before init()")
            if self._state.state not in (KVPoll.WaitingForInput, KVPoll.Transferring) or self._last_sent:
                raise StateError(f"{self._state.where}: send() in state {self._state.state.name}"
                                 + (" after the last chunk" if self._last_sent else ""))
            pages = host_page_ids(page_indices)
            if state_indices is not None and not last:
                raise StateError(f"{self._state.where}: state indices go with the last chunk (last=True)")
            if layers is None and self._groups is not None:
                raise StateError(f"{self._state.where}: send() of a whole chunk while the chunk at page "
                                 f"{self._offset} still lacks layer(s) {self._groups.missing()[:8]}")
            states = () if state_indices is None else \
                tuple(None if i is None else host_page_ids(i) for i in state_indices)
            gate = gate_for(ready, self._ctx.config.transfer_timeout_s, self._state.where)
            if layers is not None:
                self._send_group(pages, last, gate, states, layers)
                return
            self._last_send_at, self._last_gate = time.monotonic(), gate
            plan = self._plan(Chunk(pages, self._offset, last, self._next_part), states)
            if plan is not None:
                self._submit(plan, pages, last, gate, complete=True)

    def _plan(self, chunk: Chunk, states):
        """``chunk`` planned (None: the plan's checks failed the room)."""
        room = SendingRoom(self._state.where, self._ctx.rank, tuple(self._requests), self._table.peers,
                           self._num_pages, self._aux_index, states)
        try:
            return plan_chunk(room, chunk, self._ctx.config)
        except (ValueError, IndexError) as exc:  # the plan's checks: page ids, sizes
            kind = PageIndexError if isinstance(exc, IndexError) else RequestError
            self.fail(exc if isinstance(exc, KVFerryError) else kind(f"{self._state.where}: {exc}"))
            return None

    def _send_group(self, pages, last: bool, gate, states, layers) -> None:
        """One layer group of the current chunk (under the lock)."""
        spans = layer_spans(self._ctx.rank.pools)
        try:
            wanted = parse_layers(layers, num_layers(spans))
            if self._groups is None:
                self._groups = ChunkGroups(pages, last, num_layers(spans))
                # a short room's groups go whole (layerwise_min_tokens): streaming would not pay for its calls
                tokens = self._num_pages * self._ctx.rank.pools[0].page_size
                self._groups.deferred = tokens < self._ctx.config.layerwise_min_tokens
            self._groups.add(pages, last, wanted)
        except ValueError as exc:
            raise StateError(f"{self._state.where}: {exc}") from None
        groups = self._groups
        groups.states = states or groups.states  # state items go with the completing group of the last chunk
        states = groups.states
        self._last_send_at, self._last_gate = time.monotonic(), gate
        complete = groups.complete
        if not groups.deferred:
            chunk = Chunk(pages, self._offset, last and complete, self._next_part, layers=by_pool(wanted, spans))
            plan = self._plan(chunk, states)
            if plan is not None:
                self._submit(plan, pages, last, gate, complete)
            return
        if complete:  # a deferred chunk goes whole, gated on its completing group's event
            plan = self._plan(Chunk(pages, self._offset, last, self._next_part), states)
            if plan is not None:
                self._submit(plan, pages, last, gate, complete=True)

    def _submit(self, plan, pages, last: bool, gate, complete: bool) -> None:
        """Hand a planned chunk (or layer group) to the transport and the
        staged flow; a ``complete`` chunk moves the room on (under the lock)."""
        first = self._offset
        if complete:
            self._groups = None
            self._offset += pages.size
            self._last_sent = last
        self._next_part = plan.next_part
        self._num_inflight += len(plan.jobs) + len(plan.parts)
        if self._state.state is KVPoll.WaitingForInput:
            self._state.move(KVPoll.Transferring)
        if self._write_through is not None and complete:  # queued first: the room's success waits for it
            self._write_through.write(pages, first, self._aux_index if last else None, self._on_storage_done,
                                      ready=gate)
        for job in plan.jobs:
            handle = self._ctx.transport.submit(job.session, job.plan,
                                                lambda error, m=job.moved: self.on_chunk_done(error, m), ready=gate,
                                                priority=self.created)  # a saturated link: oldest room first
            if handle is not None:
                self._jobs.append(handle)
        if plan.parts:
            self._parts.extend(self._table.staging.submit(self, plan.parts, ready=gate))

    def poll(self) -> KVPoll:
        """The room's state now. Also moves this rank's control messages and
        transfers along on the caller's thread (see ``RoomContext.pump``)."""
        self._ctx.pump()
        return self.update()

    def update(self) -> KVPoll:
        """Fire the room's timeouts and return its state (the room layer's
        poll: no pumping)."""
        with self._ctx.lock:
            if self._state.state is KVPoll.Failed and self._writing_through:
                return KVPoll.Transferring  # write-through still reads the pages: not free yet
            now = time.monotonic()
            if self._state.state is KVPoll.Bootstrapping and \
                    now - self._created > self._ctx.config.bootstrap_timeout_s and now > self._held_until:
                held = f" (decode held it until {now - self._held_until:.1f} s ago)" if self._held_until else ""
                self.fail(KVTimeoutError(
                    f"{self._state.where}: {len(self._requests)} decode request(s) arrived within "
                    f"{self._ctx.config.bootstrap_timeout_s:g} s{held}, expected "
                    f"{self._requests[0].num_requests if self._requests else 'at least 1'}"))
            return self._state.state

    def hold(self, until: float) -> None:
        """A decode rank holds this room (``RoomHold``): its requests are
        waited for until ``until`` (monotonic), past ``bootstrap_timeout_s``."""
        with self._ctx.lock:
            self._held_until = max(self._held_until, until)

    @property
    def held_until(self) -> float:
        """Until when (monotonic) a decode rank holds this room; 0: never held."""
        return self._held_until

    def failure_exception(self) -> None:
        """Raise the room's failure (a KVFerryError); no-op unless Failed."""
        if self._state.state is KVPoll.Failed:
            raise self._state.error

    def abort(self, reason: str = "aborted by the prefill scheduler") -> None:
        """Fail the room here and tell the decode ranks (which then do not
        restore it from storage)."""
        self._aborted = True
        self.fail(tag_reason(PeerError(f"{self._state.where}: {reason}"), FailureReason.ABORTED))

    def stats(self) -> RoomStats:
        """What this room moved so far, and when (any time, from any thread)."""
        with self._ctx.lock:
            return self._counter.snapshot(self._state.state.name)

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
            if not self._requests or len(self._requests) < self._requests[0].num_requests:
                raise StateError(f"{self._state.where}: decode_prefix_pages before every decode request arrived")
            prefixes = {r.prefix_pages for r in self._requests}
            if len(prefixes) > 1:
                raise StateError(f"{self._state.where}: decode ranks hold different prefixes: "
                                 + ", ".join(f"rank {r.decode_tp_rank} {r.prefix_pages} pages"
                                           for r in sorted(self._requests, key=lambda r: r.decode_tp_rank)))
            return prefixes.pop()

    @property
    def requests(self) -> tuple[TransferRequest, ...]:
        """The decode requests that arrived for this room."""
        return tuple(self._requests)

    @property
    def awaiting_requests(self) -> bool:
        """Whether the room still waits for decode requests."""
        return not self._requests or len(self._requests) < self._requests[0].num_requests

    def on_message(self, msg) -> None:
        """A TransferRequest or RoomAbort for this room."""
        with self._ctx.lock:
            if self._state.terminal:
                return
            if isinstance(msg, RoomAbort):
                # An abort of a request not here yet is for the request that
                # session would send (the table took it from a handshaken peer,
                # or one whose handshake was refused for its layout).
                if msg.request_id in [r.request_id for r in self._requests] or (
                        self.awaiting_requests and msg.session not in [r.decode_session for r in self._requests]):
                    self.fail(tag_reason(PeerError(f"{self._state.where}: decode aborted the room: {msg.reason} "
                                                   f"[prefill then: {self.progress()}]"), FailureReason.ABORTED))
                return
            if not self._table.is_peer(msg.decode_session, "", msg.decode_endpoint):
                self._table.refused_unhandshaken()  # its handshake changed since the table took it
                return
            if msg.request_id in [r.request_id for r in self._requests]:
                self._table.dropped_replay()
                return
            problem = self._duplicate(msg)
            if problem:
                self._table.refuse_request(msg, problem)
                return
            self._requests.append(msg)
            if len(self._requests) == msg.num_requests:
                log.debug("%s: requested by %d decode rank(s)", self._state.where, msg.num_requests)
                self._state.move(KVPoll.WaitingForInput)
                self._check_sizes()

    def on_chunk_done(self, error, moved=()) -> None:
        """A transport job or staged part of this room ended (``error`` None:
        it landed); called once per job or part submitted. ``moved``: the
        job's (pool, path, bytes, descriptors), counted when it landed."""
        with self._ctx.lock:
            self._num_inflight -= 1
            if error is None:
                for entry in moved:
                    self._counts.land(*entry)
            if self._state.state is KVPoll.Failed:
                self._tell_failure_when_drained()
                return
            if error is not None:
                self.fail(error)
                return
            if self._state.terminal or not self._last_sent or self._num_inflight:
                return
            try:
                self._notify(Status.SUCCESS, "")
            except Exception as exc:
                self.fail(exc)
                return
            self._decode_told = True
            if not self._writing_through:  # else when the write-through is done
                self._succeed()

    def release(self, error: BaseException) -> None:
        """The scheduler releases the KV memory (``KVManager.release_memory``): fail the room."""
        self.fail(error)

    def released(self) -> bool:
        """Whether nothing of this room reads the pools any more: ended, no
        write in flight, no write-through (``KVManager.release_memory``)."""
        with self._ctx.lock:
            return self._state.terminal and self._num_inflight == 0 and not self._writing_through

    def progress(self) -> str:
        """Where the room stands, for a failure's message (under the lock):
        what a reader at 3 a.m. needs to tell a lost message from a stuck write."""
        return (f"{self._state.state.name}, {len(self._requests)} decode request(s), "
                f"{'last chunk sent' if self._last_sent else 'last chunk not sent'}, "
                f"{self._num_inflight} write(s) in flight, {self._counter.total_bytes} bytes landed"
                + (", write-through pending" if self._writing_through else "")
                + "".join(f"; {self._ctx.transport.describe_job(job)}" for job in self._jobs if not job.done)
                + "".join(f"; {self._table.staging.describe(part)}" for part in self._parts if not part.ended))

    def on_part_landed(self, spec: StagedSpec) -> None:
        """A staged part's write landed (before ``on_chunk_done``)."""
        with self._ctx.lock:
            self._counts.part_landed(spec)

    def fail(self, error: BaseException, *, notify: bool = True) -> None:
        """Fail the room, stop submitting its writes, and tell decode once
        none is in flight any more (decode then knows its pages are free)."""
        with self._ctx.lock:
            if not self._state.fail(error):
                return
            self._counts.ended(error, side="prefill", config=self._ctx.config,
                               peer=",".join(sorted({r.decode_session for r in self._requests})))
            for job in self._jobs:  # a write-through goes on: its pages are valid KV whatever the transfer did
                job.cancel()
            self._jobs.clear()
            self._table.detach(self, [r.request_id for r in self._requests])
            if not self._requests or len(self._requests) < self._requests[0].num_requests:
                self._table.refuse_later(self.room, str(error))
            self._failure_note = str(error) if notify else None
            if self._table.staging is not None:
                self._table.staging.release(self)
            self._tell_failure_when_drained()

    # --- internals --------------------------------------------------------------

    @property
    def _writing_through(self) -> bool:
        """Whether write-through jobs still read this room's pages."""
        return self._write_through is not None and self._write_through.num_pending > 0

    def _on_storage_done(self, job) -> None:
        """A write-through job ended (on the tier's thread)."""
        with self._ctx.lock:
            self._write_through.settle(job)
            if self._state.state is KVPoll.Transferring and self._decode_told and not self._writing_through:
                self._succeed()
            elif self._state.terminal:
                self._ctx.changed(self, self._state.state)  # poll() may now report it

    def _succeed(self) -> None:
        self._counts.ended(None, side="prefill", config=self._ctx.config)
        self._state.move(KVPoll.Success)
        self._table.detach(self, [r.request_id for r in self._requests])

    def _duplicate(self, req: TransferRequest) -> str:
        """Why ``req`` cannot join this room's requests ("" if it can): a
        room takes one request per decode TP rank, as many as the first said."""
        if not self._requests:
            return ""
        if not self.awaiting_requests:
            return f"it has all the {self._requests[0].num_requests} decode request(s) it expects"
        if req.num_requests != self._requests[0].num_requests:
            return f"it expects {self._requests[0].num_requests} decode requests, this one says {req.num_requests}"
        if req.decode_tp_rank in [r.decode_tp_rank for r in self._requests]:
            return f"it already has a request from decode TP rank {req.decode_tp_rank}"
        return ""

    def _check_sizes(self) -> None:
        if self._num_pages is None:
            return
        for req in self._requests:
            if len(req.dst_pages) // 4 != self._num_pages:
                self.fail(RequestError(f"{self._state.where}: decode rank {req.decode_tp_rank} allocated "
                                      f"{len(req.dst_pages) // 4} pages, this request has {self._num_pages}"))

    def _forward_end(self) -> float:
        """When the scheduler's forward ended as this rank saw it: its last
        ``send()`` call, or, when that call passed a ready event, the event's
        completion (an engine on a GPU calls ``send()`` as it launches the
        work, before the work is done)."""
        gate = self._last_gate
        done_at = gate.done_at if gate is not None else None
        return self._last_send_at if done_at is None else max(self._last_send_at, done_at)

    def _notify(self, status: Status, reason: str) -> None:
        exposed = time.monotonic() - self._forward_end() \
            if status is Status.SUCCESS and self._last_send_at is not None else 0.0
        for req in self._requests:
            sent = tuple(a.role for a in req.assignments if a.send)
            row, peer = b"", self._table.peers.get(req.decode_session)
            if status is Status.SUCCESS and req.dst_aux_index >= 0 and self._aux_index is not None \
                    and self._ctx.aux and peer is not None and peer.fenced:
                row = aux_row(self._ctx.aux, self._aux_index)  # a fenced rank's aux is not writable
            self._ctx.channel.send(req.decode_endpoint, RoomStatus(
                room=self.room, request_id=req.request_id, prefill_tp_rank=self._ctx.rank.tp_rank,
                status=status, sent=sent if status is Status.SUCCESS else (), reason=reason,
                aborted=self._aborted, aux_row=row, exposed_s=exposed))

    def _tell_failure_when_drained(self) -> None:
        if self._failure_note is None or self._num_inflight > 0:
            return
        note, self._failure_note = self._failure_note, None
        try:
            self._notify(Status.FAILED, note)
        except Exception as exc:  # the room is failed either way
            log.warning("%s: could not tell decode: %s", self._state.where, exc)
