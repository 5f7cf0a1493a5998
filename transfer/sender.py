"""Prefill side: KVSender (one per request) and the rank's room table."""

from __future__ import annotations

import collections
import logging
import time

import numpy as np

from bootstrap.messages import AttentionKind, RankInfo
from transfer.errors import IncompatibleLayoutError, PeerError, StateError, KVTimeoutError
from transfer.layout import check_compatible
from transfer.messages import (PeerHello, PeerHelloReply, RoomAbort, RoomStatus, StageGrant, Status,
                               TransferRequest)
from transfer.plan import TransferPlan, check_transfer, page_runs, page_slice, plan_aux, plan_pool
from transfer.stageflow import PrefillStaging, part_bytes_for, plan_parts
from transfer.state import KVPoll, RoomState

log = logging.getLogger("kvferry.sender")

_REMEMBER_FINISHED = 65536
# Bounds on requests kept for rooms whose sender the scheduler has not created
# yet (a decode rank may be early; a flood must not exhaust memory).
_EARLY_ROOMS = 4096
_EARLY_PER_ROOM = 64


class PrefillRooms:
    """Routes control messages to the live senders of a prefill rank.

    Requests may arrive before the scheduler creates the room's sender; they
    wait (at most ``bootstrap_timeout_s``) and are handed over on creation.
    Messages for rooms that already ended, matched by (room, request_id), are
    dropped, so a reused room id never picks up a stale request.
    """

    def __init__(self, mgr) -> None:
        self.mgr = mgr
        self.peers: dict[str, RankInfo] = {}  # decode session -> its rank info
        self.senders: dict[int, KVSender] = {}
        self._early: dict[int, list[tuple[float, object]]] = {}  # insertion order = age
        # Rooms whose sender failed before every decode request arrived: a
        # late request gets the failure at once instead of waiting out its
        # timeout (until a new sender takes the room id, or bootstrap_timeout_s).
        self._refused: dict[int, tuple[float, str]] = {}
        self.num_dropped_early = 0
        self._finished: collections.OrderedDict[tuple[int, int], None] = collections.OrderedDict()
        self.staging = PrefillStaging(mgr) if mgr.staging is not None else None

    def on_message(self, msg) -> None:
        if isinstance(msg, PeerHello):
            self._on_hello(msg)
            return
        if isinstance(msg, StageGrant) and self.staging is not None:
            self.staging.on_grant(msg)
            return
        if not isinstance(msg, (TransferRequest, RoomAbort)):
            log.warning("%s: ignored a %s message", self.mgr.where, msg.KIND)
            return
        with self.mgr._lock:
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
        sender._on_message(msg)

    def refuse_later(self, room: int, reason: str) -> None:
        """The room's sender failed before all its requests arrived."""
        now = time.monotonic()
        if len(self._refused) >= _EARLY_ROOMS:
            horizon = now - self.mgr.config.bootstrap_timeout_s
            for r in [r for r, (t, _) in self._refused.items() if t < horizon] or [next(iter(self._refused))]:
                del self._refused[r]
        self._refused[room] = (now, reason)

    def _refuse(self, req: TransferRequest) -> bool:
        refused = self._refused.get(req.room)
        if refused is None or time.monotonic() - refused[0] > self.mgr.config.bootstrap_timeout_s:
            return False
        self._finished[(req.room, req.request_id)] = None
        peer = self.peers.get(req.decode_session)
        if peer is not None:
            try:
                self.mgr.channel.send(peer.control_endpoint, RoomStatus(
                    room=req.room, request_id=req.request_id, prefill_tp_rank=self.mgr.rank.tp_rank,
                    status=Status.FAILED, sent=(), reason=f"{self.mgr.where} room {req.room} ended before this "
                                                         f"request arrived: {refused[1]}"))
            except Exception as exc:
                log.warning("%s: could not tell decode: %s", self.mgr.where, exc)
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
                    self.mgr.channel.send(peer.control_endpoint, RoomStatus(
                        room=msg.room, request_id=msg.request_id, prefill_tp_rank=self.mgr.rank.tp_rank,
                        status=Status.FAILED, sent=(), reason=f"{self.mgr.where}: aborted before its sender existed"))
                except Exception as exc:
                    log.warning("%s: could not tell decode: %s", self.mgr.where, exc)

    def _keep_early(self, msg) -> None:
        """Keep a message for a room whose sender does not exist yet, within
        bounds: at most ``_EARLY_ROOMS`` rooms (the oldest go first) of at
        most ``_EARLY_PER_ROOM`` messages, each for ``bootstrap_timeout_s``."""
        now = time.monotonic()
        horizon = now - self.mgr.config.bootstrap_timeout_s
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
            check_compatible(self.mgr.rank, hello.rank, local_is_prefill=True,
                             allow_missing_draft=hello.allow_missing_draft)
        except IncompatibleLayoutError as exc:
            log.error("%s: refused decode rank %s: %s", self.mgr.where, hello.rank.session, exc)
            reply = PeerHelloReply(session=self.mgr.rank.session, ok=False, field=exc.field,
                                   reason=f"{self.mgr.where}: {exc}")
        else:
            with self.mgr._lock:
                self.peers[hello.rank.session] = hello.rank
            reply = PeerHelloReply(session=self.mgr.rank.session, ok=True, field="", reason="")
        self.mgr.channel.send(hello.rank.control_endpoint, reply)

    def attach(self, sender: "KVSender") -> list:
        with self.mgr._lock:
            old = self.senders.get(sender.room)
            if old is not None and not old._state.terminal:
                raise StateError(f"{self.mgr.where}: room {sender.room} already has a live sender")
            self.senders[sender.room] = sender
            self._refused.pop(sender.room, None)
            horizon = time.monotonic() - self.mgr.config.bootstrap_timeout_s
            return [m for t, m in self._early.pop(sender.room, []) if t >= horizon]

    def detach(self, sender: "KVSender", request_ids) -> None:
        with self.mgr._lock:
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
                for s in self.senders.values() if not s._state.terminal for req in s._requests}

    def peer_lost(self, session: str, silent_s: float) -> None:
        """A decode rank went silent: fail the rooms it asked for."""
        with self.mgr._lock:
            senders = [s for s in self.senders.values()
                       if any(r.decode_session == session for r in s._requests)]
        for s in senders:
            s._fail(PeerError(f"{s._state.where}: decode rank {session} silent for more than {silent_s:g} s: "
                              "dead, stopped or unreachable"))

    def close(self, error: BaseException) -> None:
        with self.mgr._lock:
            senders = list(self.senders.values())
        for s in senders:
            s._fail(error)


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

    def __init__(self, mgr, bootstrap_addr: str | None, bootstrap_room: int) -> None:
        mgr.check_open()
        self.mgr = mgr
        self.room = int(bootstrap_room)
        self._state = RoomState(f"{mgr.where} room {self.room}", on_change=mgr._changed)
        self._created = time.monotonic()
        self._requests: list[TransferRequest] = []
        self._num_pages: int | None = None
        self._aux_index: int | None = None
        self._offset = 0
        self._last_sent = False
        self._num_inflight = 0
        self._next_part = 0
        self._jobs: list = []  # transport handles, cancelled if the room fails
        self._failure_note: str | None = None  # to send decode once nothing is in flight
        self._chains: list[bytes] | None = None  # the prompt's page chain hashes (write-through)
        self._aux_key: str | None = None
        self._storage_pending = 0  # write-through jobs still reading this room's pages
        self._decode_told = False
        self._aborted = False  # by this side's scheduler
        for msg in mgr.rooms.attach(self):
            self._on_message(msg)

    # --- scheduler API ----------------------------------------------------------

    def init(self, num_pages: int, aux_index: int | None = None, token_ids=None) -> None:
        """Declare the request's total pages and its aux slot on this rank.
        ``token_ids`` (the prompt) lets the storage tier write the sent pages
        through (when the manager has one)."""
        with self.mgr._lock:
            if self._num_pages is not None:
                raise StateError(f"{self._state.where}: init() called twice")
            self._num_pages, self._aux_index = int(num_pages), aux_index
            tier = self.mgr.storage
            if tier is not None and token_ids is not None and self.mgr.config.storage_write_through:
                self._chains = tier.chains(token_ids)[:self._num_pages]
                self._aux_key = tier.aux_key(token_ids)
            self._check_sizes()

    def send(self, page_indices, last: bool = False) -> None:
        """Queue the next chunk's pages (prefill page ids, in request order).
        Allowed in WaitingForInput or Transferring, before the last chunk; on
        a Failed room it does nothing. Returns at once; problems with the pages
        fail the room (see ``poll``)."""
        with self.mgr._lock:
            if self._state.state is KVPoll.Failed:
                return
            if self._num_pages is None:
                raise StateError(f"{self._state.where}: send() before init()")
            if self._state.state not in (KVPoll.WaitingForInput, KVPoll.Transferring) or self._last_sent:
                raise StateError(f"{self._state.where}: send() in state {self._state.state.name}"
                                 + (" after the last chunk" if self._last_sent else ""))
            pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
            try:
                jobs, parts = self._plan_chunk(pages, last)
            except (ValueError, IndexError) as exc:
                self._fail(exc)
                return
            self._offset += pages.size
            self._last_sent = last
            self._num_inflight += len(jobs) + len(parts)
            if self._state.state is KVPoll.WaitingForInput:
                self._state.move(KVPoll.Transferring)
            if self._chains is not None:  # queued first: the room's success waits for it
                self._write_through(pages, self._offset - pages.size, last)
            for session, plan in jobs:
                handle = self.mgr.transport.submit(session, plan, self._on_chunk_done)
                if handle is not None:
                    self._jobs.append(handle)
            if parts:
                self.mgr.rooms.staging.submit(parts)

    def poll(self) -> KVPoll:
        with self.mgr._lock:
            if self._state.state is KVPoll.Failed and self._storage_pending:
                return KVPoll.Transferring  # write-through still reads the pages: not free yet
            if self._state.state is KVPoll.Bootstrapping and \
                    time.monotonic() - self._created > self.mgr.config.bootstrap_timeout_s:
                self._fail(KVTimeoutError(
                    f"{self._state.where}: {len(self._requests)} decode request(s) arrived within "
                    f"{self.mgr.config.bootstrap_timeout_s:g} s, expected "
                    f"{self._requests[0].num_requests if self._requests else 'at least 1'}"))
            return self._state.state

    def failure_exception(self) -> None:
        """Raise the room's failure (a KVFerryError); no-op unless Failed."""
        if self._state.state is KVPoll.Failed:
            raise self._state.error

    def abort(self, reason: str = "aborted by the prefill scheduler") -> None:
        """Fail the room here and tell the decode ranks (which then do not
        restore it from storage)."""
        self._aborted = True
        self._fail(PeerError(f"{self._state.where}: {reason}"))

    # --- internals --------------------------------------------------------------

    def _write_through(self, pages: np.ndarray, first: int, last: bool) -> None:
        """Queue the chunk's full pages (and, with the last chunk, the aux
        row) for the storage tier. MLA pools are the same on every TP rank,
        so only rank 0 writes them."""
        tier, rank = self.mgr.storage, self.mgr.rank
        end = min(first + pages.size, len(self._chains))
        items = {}
        if end > first:
            chains = self._chains[first:end]
            for role in tier.pools:
                if rank.pool(role).attention is AttentionKind.MLA and rank.tp_rank != 0:
                    continue
                items[role] = (tier.keys(role, chains), pages[:end - first].tolist())
        aux = (self._aux_key, self._aux_index) if last and self._aux_index is not None and rank.tp_rank == 0 \
            and tier._aux is not None else None
        if not items and aux is None:
            return
        self._storage_pending += 1
        tier.write(items, aux, self._on_storage_done)

    def _on_storage_done(self, job) -> None:
        with self.mgr._lock:
            self._storage_pending -= 1
            if job.error is not None:
                log.warning("%s: write-through failed (the transfer is not affected): %s", self._state.where,
                            job.error)
            if self._state.state is KVPoll.Transferring and self._decode_told and not self._storage_pending:
                self._succeed()
            elif self._state.terminal:
                self.mgr._changed()  # poll() may now report the terminal state

    def _succeed(self) -> None:
        self._state.move(KVPoll.Success)
        self.mgr.rooms.detach(self, [r.request_id for r in self._requests])

    def _plan_chunk(self, pages: np.ndarray, last: bool) -> tuple[list[tuple[str, TransferPlan]], list]:
        """Direct descriptor plans per decode rank, and staged parts where
        direct descriptors would be small (scattered pages, head slices)."""
        end = self._offset + pages.size
        if end > self._num_pages:
            raise ValueError(f"{self._state.where}: {end} pages sent, more than the {self._num_pages} of init()")
        if last and end != self._num_pages:
            raise ValueError(f"{self._state.where}: last chunk ends at page {end} of {self._num_pages}")
        local = self.mgr.rank
        jobs, staged = [], []
        for req in self._requests:
            peer = self.mgr.rooms.peers[req.decode_session]
            skip = min(pages.size, max(0, req.skip_pages - self._offset))  # decode has these from storage
            src = pages[skip:]
            dst = np.frombuffer(req.dst_pages, dtype="<i4")[self._offset + skip:end]
            sent = [a for a in req.assignments if a.send] if src.size else []
            plans = []
            if sent and self._stage(src, dst, sent, local, peer):
                for a in sent:  # the same checks as the direct path, before any byte moves
                    check_transfer(local.pool(a.role), peer.pool(a.role), src, dst.astype(np.int64),
                                   src_head_offset=a.src_head_offset, dst_head_offset=a.dst_head_offset,
                                   num_heads=a.num_heads)
                new = plan_parts(self, req, src, self._offset + skip, local, peer, part_bytes_for(self.mgr, peer),
                                 self._next_part)
                self._next_part += len(new)
                staged.extend(new)
            else:
                plans = [plan_pool(local.pool(a.role), peer.pool(a.role), src, dst,
                                   src_head_offset=a.src_head_offset, dst_head_offset=a.dst_head_offset,
                                   num_heads=a.num_heads) for a in sent]
            if last and local.aux is not None and self._aux_index is not None and req.dst_aux_index >= 0:
                plans.append(plan_aux(local.aux, peer.aux, self._aux_index, req.dst_aux_index))
            # Always a job, empty or not: its completion is what ends a room
            # for ranks that send nothing.
            jobs.append((req.decode_session, TransferPlan.concat(plans)))
        return jobs, staged

    def _stage(self, pages, dst, sent, local, peer) -> bool:
        """Whether this chunk goes through staging: both sides have it and the
        direct descriptors would average less than ``stage_below_bytes``."""
        if self.mgr.staging is None or peer.staging is None or not pages.size:
            return False
        runs = page_runs(pages, dst).lengths.size
        total = count = 0
        for a in sent:
            pool = local.pool(a.role)
            sl, dl = page_slice(pool, a.src_head_offset, a.num_heads), \
                page_slice(peer.pool(a.role), a.dst_head_offset, a.num_heads)
            buffers = len(pool.buffers)
            whole = sl.rows == dl.rows == 1 and sl.nbytes == sl.row_bytes and dl.nbytes == dl.row_bytes
            total += pages.size * sl.packed_bytes * buffers
            count += runs * buffers if whole else pages.size * sl.rows * buffers
        return total / count < self.mgr.config.stage_below_bytes

    def _check_sizes(self) -> None:
        if self._num_pages is None:
            return
        for req in self._requests:
            if len(req.dst_pages) // 4 != self._num_pages:
                self._fail(ValueError(f"{self._state.where}: decode rank {req.decode_tp_rank} allocated "
                                      f"{len(req.dst_pages) // 4} pages, this request has {self._num_pages}"))

    def _on_message(self, msg) -> None:
        with self.mgr._lock:
            if self._state.terminal:
                return
            if isinstance(msg, RoomAbort):
                # Before any request arrived, the abort is for the request this
                # sender would get (request ids are random per decode room).
                if not self._requests or msg.request_id in [r.request_id for r in self._requests]:
                    self._fail(PeerError(f"{self._state.where}: decode aborted the room: {msg.reason}"))
                return
            peer = self.mgr.rooms.peers.get(msg.decode_session)
            if peer is None or peer.control_endpoint != msg.decode_endpoint:
                self._fail(PeerError(f"{self._state.where}: request from decode {msg.decode_session} "
                                     + ("which has not completed the handshake" if peer is None else
                                        f"names endpoint {msg.decode_endpoint}, not its handshake's "
                                        f"{peer.control_endpoint}")))
                return
            self._requests.append(msg)
            if len(self._requests) > msg.num_requests:
                self._fail(PeerError(f"{self._state.where}: {len(self._requests)} decode requests, "
                                     f"expected {msg.num_requests}"))
            elif len(self._requests) == msg.num_requests:
                self._state.move(KVPoll.WaitingForInput)
                self._check_sizes()

    def _on_chunk_done(self, error) -> None:
        with self.mgr._lock:
            self._num_inflight -= 1
            if self._state.state is KVPoll.Failed:
                self._tell_failure_when_drained()
                return
            if error is not None:
                self._fail(error)
                return
            if self._state.terminal or not self._last_sent or self._num_inflight:
                return
            try:
                self._notify(Status.SUCCESS, "")
            except Exception as exc:
                self._fail(exc)
                return
            self._decode_told = True
            if not self._storage_pending:  # else when the write-through is done
                self._succeed()

    def _notify(self, status: Status, reason: str) -> None:
        for req in self._requests:
            sent = tuple(a.role for a in req.assignments if a.send)
            self.mgr.channel.send(req.decode_endpoint, RoomStatus(
                room=self.room, request_id=req.request_id, prefill_tp_rank=self.mgr.rank.tp_rank,
                status=status, sent=sent if status is Status.SUCCESS else (), reason=reason,
                aborted=self._aborted))

    def _fail(self, error: BaseException, *, notify: bool = True) -> None:
        """Fail the room, stop submitting its writes, and tell decode once
        none is in flight any more (decode then knows its pages are free)."""
        with self.mgr._lock:
            if not self._state.fail(error):
                return
            log.warning("%s failed: %s", self._state.where, error)
            for job in self._jobs:  # a write-through goes on: its pages are valid KV whatever the transfer did
                job.cancel()
            self._jobs.clear()
            self.mgr.rooms.detach(self, [r.request_id for r in self._requests])
            if not self._requests or len(self._requests) < self._requests[0].num_requests:
                self.mgr.rooms.refuse_later(self.room, str(error))
            self._failure_note = str(error) if notify else None
            if self.mgr.rooms.staging is not None:
                self.mgr.rooms.staging.release(self)
            self._tell_failure_when_drained()

    def _tell_failure_when_drained(self) -> None:
        if self._failure_note is None or self._num_inflight > 0:
            return
        note, self._failure_note = self._failure_note, None
        try:
            self._notify(Status.FAILED, note)
        except Exception as exc:  # the room is failed either way
            log.warning("%s: could not tell decode: %s", self._state.where, exc)
