"""Decode side: KVReceiver, one per request."""

from __future__ import annotations

import logging
import random
import time

import numpy as np

from bootstrap.messages import PoolRole
from transfer.errors import KVFerryError, KVTimeoutError, PeerError, ProtocolError, StateError, TransferError
from transfer.links import Link, LinkState
from transfer.messages import RoomAbort, Status, TransferRequest
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
        with mgr._lock:
            self.mgr.rooms.receivers[(self.room, self.request_id)] = self

    def init(self, page_indices, aux_index: int | None = None) -> None:
        """The decode pages (in request order) and aux slot to fill."""
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
        self.poll()

    def poll(self) -> KVPoll:
        with self.mgr._lock:
            st = self._state
            if st.terminal:
                return st.state
            now = time.monotonic()
            if st.state is KVPoll.Bootstrapping:
                self._bootstrap(now)
            if st.state is KVPoll.WaitingForInput and self._pages is not None:
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
        """Fail the room here and tell the prefill ranks."""
        self._fail(PeerError(f"{self._state.where}: {reason}"))

    # --- internals --------------------------------------------------------------

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
                    assignments=assignments, num_requests=link.num_requests[p]))
        except KVFerryError as exc:
            self._fail(exc)

    def _on_message(self, msg) -> None:
        if self._state.state is not KVPoll.Transferring:
            return
        if isinstance(msg, RoomAbort):
            self._fail(PeerError(f"{self._state.where}: prefill aborted the room: {msg.reason}"), notify=False)
            return
        where = f"prefill rank {msg.prefill_tp_rank} of {self._link.name}"
        if msg.status is Status.FAILED:
            self._fail(PeerError(f"{self._state.where}: {where} failed: {msg.reason}"), notify=False)
            return
        expected = self._awaiting.get(msg.prefill_tp_rank)
        if expected is None:
            return  # a duplicate or a rank we did not ask
        if set(msg.sent) != expected:
            self._fail(ProtocolError(f"{self._state.where}: {where} sent pools "
                                     f"{sorted(r.value for r in msg.sent)}, expected {sorted(r.value for r in expected)}"))
            return
        del self._awaiting[msg.prefill_tp_rank]
        if not self._awaiting:
            self._state.move(KVPoll.Success)
            self.mgr.rooms.receivers.pop((self.room, self.request_id), None)

    def _scatter(self, msg, offset: int) -> None:
        """Unpack a staged part from prefill rank ``msg.prefill_tp_rank``."""
        if self._state.state is not KVPoll.Transferring:
            return
        try:
            scatter_part(self.mgr, self, msg, offset, self._link.routes[msg.prefill_tp_rank])
        except Exception as exc:
            self._fail(TransferError(f"{self._state.where}: scattering staged part {msg.part}: {exc}"))

    def _fail(self, error: BaseException, *, notify: bool = True) -> None:
        with self.mgr._lock:
            if not self._state.fail(error):
                return
            self.mgr.rooms.receivers.pop((self.room, self.request_id), None)
            if self.mgr.rooms.staging is not None:
                self.mgr.rooms.staging.release_room(self.room, self.request_id)
            log.warning("%s failed: %s", self._state.where, error)
            link = self._link
            if not notify or link is None or not link.ranks:
                return
            # Every prefill rank of the room learns it is over, also those a
            # failed handshake kept us from sending a request to.
            targets = link.routes or {r.tp_rank: () for r in link.ranks}
            for p in targets:
                try:
                    self.mgr.channel.send(link.ranks[p].control_endpoint, RoomAbort(
                        room=self.room, request_id=self.request_id if self._awaiting else 0,
                        reason=str(error)))
                except KVFerryError as exc:
                    log.warning("%s: could not tell prefill rank %d: %s", self._state.where, p, exc)
