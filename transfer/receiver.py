"""Decode side: KVReceiver, one per request."""

from __future__ import annotations

import logging
import random
import time

import numpy as np

from bootstrap.messages import PoolRole
from transfer.errors import (KVFerryError, KVTimeoutError, PeerError, ProtocolError, StateError, StorageMissError,
                             TransferError)
from transfer.links import Link, LinkState
from transfer.messages import RoomAbort, RoomStatus, Status, TransferRequest
from transfer.stageflow import scatter_part
from transfer.state import KVPoll, RoomState

log = logging.getLogger("kvferry.receiver")

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

    def __init__(self, mgr, bootstrap_addr: str, bootstrap_room: int, *, prefill_node: str | None = None,
                 prefill_dp_rank: int | None = None) -> None:
        mgr.check_open()
        self.mgr = mgr
        self.room = int(bootstrap_room)
        self.request_id = random.getrandbits(63) | 1
        self.bootstrap_addr = bootstrap_addr
        self.prefill_node = prefill_node or mgr.config.node_id
        self.prefill_dp_rank = prefill_dp_rank
        self._state = RoomState(f"{mgr.where} room {self.room}", on_change=mgr._changed)
        self._created = time.monotonic()
        self._link: Link | None = None
        self._pages: np.ndarray | None = None
        self._aux_index = -1
        self._init_at = 0.0
        self._awaiting: dict[int, set[PoolRole]] = {}
        self._failing: BaseException | None = None  # failed, waiting for the ranks below to stop writing
        self._draining: set[int] = set()
        self._drain_deadline = 0.0
        self._tokens = None  # the prompt, for the storage tier
        self._prefetch = None  # storage job loading the leading pages before the request goes out
        self._skip = 0  # leading pages that came from storage: prefill does not send them
        self._fallback = None  # storage job restoring a failed room
        self._may_fall_back = False
        #: pages of this room restored from storage (prefetch and fallback)
        self.pages_from_storage = 0
        #: False when the room succeeded from storage without its draft pages
        self.draft_restored = True
        with mgr._lock:
            self.mgr.rooms.receivers[(self.room, self.request_id)] = self

    def init(self, page_indices, aux_index: int | None = None, token_ids=None) -> None:
        """The decode pages (in request order) and aux slot to fill.
        ``token_ids`` (the prompt) lets the storage tier prefetch pages it
        has and restore the room if the transfer fails (when the manager has
        a storage tier)."""
        with self.mgr._lock:
            if self._pages is not None:
                raise StateError(f"{self._state.where}: init() called twice")
            pages = np.asarray(page_indices, dtype=np.int64).reshape(-1)
            target = self.mgr.rank.pool(PoolRole.TARGET)
            if pages.size and (pages.min() < 0 or pages.max() >= target.num_pages):
                self._fail(IndexError(f"{self._state.where}: page index outside the pool of {target.num_pages}"))
                return
            self._pages = pages.astype("<i4")
            self._aux_index = -1 if aux_index is None else int(aux_index)
            self._init_at = time.monotonic()
            tier = self.mgr.storage
            if tier is not None and token_ids is not None:
                self._tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
                if -(-self._tokens.size // tier.page_size) != pages.size:
                    self._fail(ValueError(f"{self._state.where}: {self._tokens.size} tokens take "
                                          f"{-(-self._tokens.size // tier.page_size)} pages of {tier.page_size}, "
                                          f"not the {pages.size} given"))
                    return
                if self.mgr.config.storage_prefetch != "off":
                    self._prefetch = tier.read(self._storage_items(0), None, self._storage_done)
        self.poll()

    def poll(self) -> KVPoll:
        with self.mgr._lock:
            st = self._state
            if st.terminal:
                return st.state
            now = time.monotonic()
            if self._failing is not None:
                if self._fallback is None and now > self._drain_deadline:
                    log.warning("%s: prefill ranks %s did not confirm they stopped writing within %g s",
                                st.where, sorted(self._draining), self.mgr.config.peer_timeout_s)
                    self._finish_fail(self._failing)
                return st.state
            if st.state is KVPoll.Bootstrapping:
                self._bootstrap(now)
            if st.state is KVPoll.WaitingForInput and self._pages is not None and self._prefetched(now):
                self._send_requests()
            if st.state is KVPoll.Transferring and now - self._init_at > self.mgr.config.transfer_timeout_s:
                self._fail(KVTimeoutError(
                    f"{st.where}: no completion from prefill ranks {sorted(self._awaiting)} of "
                    f"{self._link.name} within {self.mgr.config.transfer_timeout_s:g} s"))
            return st.state

    def failure_exception(self) -> None:
        """Raise the room's failure (a KVFerryError); no-op unless Failed."""
        if self._state.state is KVPoll.Failed:
            raise self._state.error

    def abort(self, reason: str = "aborted by the decode scheduler") -> None:
        """Fail the room here and tell the prefill ranks (no storage fallback)."""
        self._fail(PeerError(f"{self._state.where}: {reason}"), fall_back=False)

    def ranks_writing(self) -> set[int]:
        """Prefill ranks that may still write into this room's pages."""
        if self._failing is not None:
            return set(self._draining)
        return set(self._awaiting) if self._state.state is KVPoll.Transferring else set()

    # --- internals --------------------------------------------------------------

    def _storage_items(self, start: int) -> dict:
        """Per pool of this rank: (keys, destination pages) of the full pages
        from request position ``start`` on."""
        tier = self.mgr.storage
        chains = tier.chains(self._tokens)
        pages = self._pages[start:len(chains)].tolist()
        return {role: (tier.keys(role, chains[start:]), pages) for role in tier.pools}

    def _storage_done(self, job) -> None:
        if job is self._fallback:
            self._fallback_done(job)
        else:
            self.poll()  # a settled prefetch lets the request go out now

    def _prefetched(self, now: float) -> bool:
        """Whether the prefetch settled (per the policy); records what it loaded."""
        job = self._prefetch
        if job is None:
            return True
        if not job.finished:
            policy = self.mgr.config.storage_prefetch
            if policy == "best_effort" or (policy == "timeout" and
                                           now - self._init_at > self.mgr.config.storage_prefetch_timeout_s):
                job.cancel()  # the batch being loaded ends, then the request goes out
            return False
        self._prefetch = None
        loaded = min(job.pages.values(), default=0) if job.error is None else 0
        self._skip = self.pages_from_storage = loaded
        return True

    def _peer_lost(self, session: str, silent_s: float) -> None:
        with self.mgr._lock:
            link = self._link
            if self._state.terminal or link is None or not link.ranks:
                return
            lost = {p for p in self.ranks_writing() if link.ranks[p].session == session}
            if not lost:
                return
            if self._failing is not None:  # a dead rank writes no more
                self._draining -= lost
                if not self._draining:
                    self._finish_fail(self._failing)
                return
            p = min(lost)
            self._fail(PeerError(f"{self._state.where}: prefill rank {p} of {link.name} ({session}) silent for "
                                 f"more than {silent_s:g} s: dead, stopped or unreachable"), stopped=lost)

    def _bootstrap(self, now: float) -> None:
        link = self.mgr.rooms.link(self.bootstrap_addr, self.prefill_node, self.prefill_dp_rank, self.room)
        if link is not None and link.state is LinkState.FAILED:
            self.mgr.rooms.forget(link)
            self._link = link
            self._fail(link.error)
            return
        if link is not None and link.state is LinkState.READY:
            self._link = link
            self._state.move(KVPoll.WaitingForInput)
            return
        if now - self._created > self.mgr.config.bootstrap_timeout_s:
            what = link.progress if link is not None else "prefill DP size unknown"
            name = link.name if link is not None else f"prefill node {self.prefill_node!r}"
            self._fail(KVTimeoutError(f"{self._state.where}: {name} not ready after "
                                      f"{self.mgr.config.bootstrap_timeout_s:g} s: {what}"))

    def _send_requests(self) -> None:
        link = self._link
        pages = self._pages.tobytes()
        for p, assignments in link.routes.items():
            self._awaiting[p] = {a.role for a in assignments if a.send}
        self._state.move(KVPoll.Transferring)
        try:
            for p, assignments in link.routes.items():
                self.mgr.channel.send(link.ranks[p].control_endpoint, TransferRequest(
                    room=self.room, request_id=self.request_id, decode_session=self.mgr.rank.session,
                    decode_endpoint=self.mgr.rank.control_endpoint, decode_tp_rank=self.mgr.rank.tp_rank,
                    dst_pages=pages, dst_aux_index=self._aux_index if p == link.aux_rank else -1,
                    assignments=assignments, num_requests=link.num_requests[p], skip_pages=self._skip))
        except KVFerryError as exc:
            self._fail(exc)

    def _on_message(self, msg) -> None:
        if self._state.state is not KVPoll.Transferring:
            return
        if self._failing is not None:
            # Any terminal word from a rank means it writes no more.
            if isinstance(msg, RoomStatus):
                self._draining.discard(msg.prefill_tp_rank)
                if not self._draining:
                    self._finish_fail(self._failing)
            return
        if isinstance(msg, RoomAbort):
            self._fail(PeerError(f"{self._state.where}: prefill aborted the room: {msg.reason}"), notify=False)
            return
        where = f"prefill rank {msg.prefill_tp_rank} of {self._link.name}"
        if msg.status is Status.FAILED:
            self._fail(PeerError(f"{self._state.where}: {where} failed: {msg.reason}"),
                       stopped={msg.prefill_tp_rank}, fall_back=not msg.aborted)
            return
        expected = self._awaiting.get(msg.prefill_tp_rank)
        if expected is None:
            return  # a duplicate or a rank we did not ask
        if set(msg.sent) != expected:
            self._fail(ProtocolError(f"{self._state.where}: {where} sent pools "
                                     f"{sorted(r.value for r in msg.sent)}, expected {sorted(r.value for r in expected)}"),
                       stopped={msg.prefill_tp_rank})
            return
        del self._awaiting[msg.prefill_tp_rank]
        if not self._awaiting:
            self._state.move(KVPoll.Success)
            self.mgr.rooms.receivers.pop((self.room, self.request_id), None)

    def _scatter(self, msg, offset: int) -> None:
        """Unpack a staged part from prefill rank ``msg.prefill_tp_rank``."""
        if self._state.state is not KVPoll.Transferring or self._failing is not None:
            return
        try:
            scatter_part(self.mgr, self, msg, offset, self._link.routes[msg.prefill_tp_rank])
        except Exception as exc:
            self._fail(TransferError(f"{self._state.where}: scattering staged part {msg.part}: {exc}"))

    def _fail(self, error: BaseException, *, notify: bool = True, stopped=(), drain: bool = True,
              fall_back: bool = True) -> None:
        """Fail the room: tell the prefill ranks (unless ``notify`` is False),
        and once every rank that may still write has stopped (``stopped``:
        ranks known to have stopped already; ``drain`` False: at once, for a
        closing manager), restore it from storage if it can (``fall_back``),
        or report Failed."""
        with self.mgr._lock:
            if self._state.terminal or self._failing is not None:
                return
            self._may_fall_back = fall_back and drain and self.mgr.config.storage_fallback and \
                self._tokens is not None and self._pages is not None
            if self._prefetch is not None:
                self._prefetch.cancel()
            writing = self.ranks_writing() - set(stopped)
            link = self._link
            if notify and link is not None and link.ranks:
                # Every prefill rank of the room learns it is over, also those
                # a failed handshake kept us from sending a request to.
                targets = link.routes or {r.tp_rank: () for r in link.ranks}
                for p in targets:
                    try:
                        self.mgr.channel.send(link.ranks[p].control_endpoint, RoomAbort(
                            room=self.room, request_id=self.request_id, reason=str(error)))
                    except KVFerryError as exc:
                        log.warning("%s: could not tell prefill rank %d: %s", self._state.where, p, exc)
                        writing.discard(p)
            if writing and drain:
                log.warning("%s failing, waiting for prefill ranks %s to stop writing: %s", self._state.where,
                            sorted(writing), error)
                self._failing, self._draining = error, writing
                self._drain_deadline = time.monotonic() + self.mgr.config.peer_timeout_s
                return
            self._finish_fail(error)

    def _finish_fail(self, error: BaseException) -> None:
        if self._state.terminal or self._fallback is not None:
            return
        if self._may_fall_back:
            # Nothing writes into the pages any more: load them from storage.
            log.warning("%s: transfer failed (%s); restoring the room from storage", self._state.where, error)
            self._failing = error
            start = self._skip
            self._fallback = self.mgr.storage.read(
                self._storage_items(start), (self.mgr.storage.aux_key(self._tokens), self._aux_index)
                if self._aux_index >= 0 else None, self._storage_done)
            self._fallback_start = start
            return
        self._really_fail(error)

    def _fallback_done(self, job) -> None:
        with self.mgr._lock:
            if self._state.terminal:
                return
            tier, start, error = self.mgr.storage, self._fallback_start, self._failing
            full = len(tier.chains(self._tokens))
            missing = []
            if job.error is not None:
                missing.append(f"storage failed: {job.error}")
            for role in tier.pools:
                got = start + job.pages.get(role, 0)
                if got < full:
                    if role is PoolRole.DRAFT and self.mgr.config.allow_missing_draft:
                        log.warning("%s: draft pages [%d, %d) not in storage; going on without draft KV "
                                    "(allow_missing_draft)", self._state.where, got, full)
                        self.draft_restored = False
                        continue
                    missing.append(f"{role.value} pages [{got}, {full}) not in storage")
            if full < len(self._pages):
                missing.append(f"page {full} (the last, partly filled) is never stored")
            if self._aux_index >= 0 and not job.aux_ok:
                missing.append("the aux row is not in storage")
            if missing:
                self._really_fail(StorageMissError(f"{error}; restoring from storage failed: {'; '.join(missing)}"))
                return
            self.pages_from_storage = full
            if self.mgr.rooms.staging is not None:
                self.mgr.rooms.staging.release_room(self.room, self.request_id)
            log.warning("%s: restored from storage after: %s", self._state.where, error)
            while self._state.state is not KVPoll.Success:  # forward through the table
                self._state.move(KVPoll(self._state.state + 1))
            self.mgr.rooms.receivers.pop((self.room, self.request_id), None)

    def _really_fail(self, error: BaseException) -> None:
        if not self._state.fail(error):
            return
        self.mgr.rooms.receivers.pop((self.room, self.request_id), None)
        if self.mgr.rooms.staging is not None:
            self.mgr.rooms.staging.release_room(self.room, self.request_id)
        log.warning("%s failed: %s", self._state.where, error)
