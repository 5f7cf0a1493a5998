"""Decode side: KVReceiver (one per request) and the rank's links to prefill nodes."""

from __future__ import annotations

import enum
import logging
import random
import threading
import time

import numpy as np

from bootstrap.client import BootstrapClient
from bootstrap.messages import AttentionKind, PoolRole, RankInfo
from transfer import tp
from transfer.errors import (BootstrapError, BootstrapUnavailable, IncompatibleLayoutError, KVFerryError,
                             KVTimeoutError, PeerError, ProtocolError, StateError, TransferError)
from transfer.layout import check_compatible
from transfer.messages import (ChunkStaged, PeerHello, PeerHelloReply, PoolAssignment, RoomAbort, RoomStatus,
                               StageRequest, Status, TransferRequest)
from transfer.stageflow import DecodeStaging, scatter_part
from transfer.state import KVPoll, RoomState

log = logging.getLogger("kvferry.receiver")

# Pause between bootstrap lookups while a prefill node is not ready yet.
_RETRY_S = 0.02


class _LinkState(enum.Enum):
    RESOLVING = "resolving"
    READY = "ready"
    FAILED = "failed"


class _Link:
    """One prefill DP group as this decode rank sees it: its ranks, and what
    each contacted rank sends for a room (the same for every room)."""

    def __init__(self, key: tuple[str, str, int]) -> None:
        self.key = key
        self.state = _LinkState.RESOLVING
        self.error: KVFerryError | None = None
        self.progress = "lookup not answered yet"
        self.ranks: tuple[RankInfo, ...] = ()
        self.routes: dict[int, tuple[PoolAssignment, ...]] = {}
        self.num_requests: dict[int, int] = {}
        self.aux_rank = -1
        self.last_wanted = time.monotonic()

    @property
    def name(self) -> str:
        addr, node, dp = self.key
        return f"prefill node {node!r} dp {dp} (bootstrap {addr})"


class _Hello:
    __slots__ = ("sent_at", "ok", "error")

    def __init__(self) -> None:
        self.sent_at = time.monotonic()
        self.ok = False
        self.error: KVFerryError | None = None


class DecodeRooms:
    """Resolves prefill nodes (bootstrap lookup, then a handshake with each
    prefill rank) on a background thread, and routes RoomStatus and RoomAbort
    messages to live receivers. A failed link is forgotten, so the next
    receiver tries afresh: no peer is blacklisted for good."""

    def __init__(self, mgr) -> None:
        self.mgr = mgr
        self.links: dict[tuple[str, str, int], _Link] = {}
        self.dp_sizes: dict[tuple[str, str], int] = {}  # 0: being looked up
        self._dp_wanted: dict[tuple[str, str], float] = {}
        self.receivers: dict[tuple[int, int], KVReceiver] = {}
        self._hellos: dict[str, _Hello] = {}
        self._clients: dict[str, BootstrapClient] = {}
        self.staging = DecodeStaging(mgr, quarantine_s=2.0 * mgr.config.engine.progress_timeout_s) \
            if mgr.staging is not None else None
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvferry-resolver", daemon=True)
        self._thread.start()

    # --- used by receivers (under mgr._lock) -----------------------------------------

    def link(self, addr: str, node: str, dp_rank: int | None, room: int) -> _Link | None:
        """The link for a room; None while the node's DP size is unknown."""
        now = time.monotonic()
        if dp_rank is None:
            dp_size = self.dp_sizes.get((addr, node))
            if dp_size is None:
                self.dp_sizes[(addr, node)] = 0
                self._wake.set()
            if not dp_size:
                self._dp_wanted[(addr, node)] = now
                return None
            dp_rank = room % dp_size
        key = (addr, node, dp_rank)
        link = self.links.get(key)
        if link is None:
            link = self.links[key] = _Link(key)
            self._wake.set()
        link.last_wanted = now
        return link

    def forget(self, link: _Link) -> None:
        if self.links.get(link.key) is link:
            del self.links[link.key]
        for r in link.ranks:
            hello = self._hellos.get(r.session)
            if hello is not None and not hello.ok:
                del self._hellos[r.session]

    # --- messages -------------------------------------------------------------------

    def on_message(self, msg) -> None:
        with self.mgr._lock:
            if isinstance(msg, PeerHelloReply):
                hello = self._hellos.get(msg.session)
                if hello is not None:
                    hello.ok = msg.ok
                    if not msg.ok:
                        hello.error = IncompatibleLayoutError(msg.field, "decode side", "prefill side",
                                                              detail=msg.reason)
                    self._wake.set()
                return
            if isinstance(msg, (RoomStatus, RoomAbort)):
                receiver = self.receivers.get((msg.room, msg.request_id))
                if receiver is not None:
                    receiver._on_message(msg)
                return
            if isinstance(msg, StageRequest) and self.staging is not None:
                self.staging.on_request(msg)
                return
            if isinstance(msg, ChunkStaged) and self.staging is not None:
                self.staging.on_staged(msg, self.receivers.get((msg.room, msg.request_id)))
                return
        log.warning("%s: ignored a %s message", self.mgr.where, msg.KIND)

    # --- resolver thread --------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(0.05)
            self._wake.clear()
            with self.mgr._lock:
                self._expire(time.monotonic() - self.mgr.config.bootstrap_timeout_s)
                dp_todo = [k for k, v in self.dp_sizes.items() if v == 0]
                todo = [l for l in self.links.values() if l.state is _LinkState.RESOLVING]
            for addr, node in dp_todo:
                try:
                    reply = self._client(addr).lookup(node, 0)
                except KVFerryError as exc:
                    log.debug("dp size of %s at %s: %s", node, addr, exc)
                    continue
                if reply.dp_size:
                    with self.mgr._lock:
                        self.dp_sizes[(addr, node)] = reply.dp_size
            for link in todo:
                try:
                    self._step(link)
                except KVFerryError as exc:
                    with self.mgr._lock:
                        link.state, link.error = _LinkState.FAILED, exc
                except Exception as exc:  # the resolver must outlive any one link
                    log.exception("resolving %s", link.name)
                    with self.mgr._lock:
                        link.state = _LinkState.FAILED
                        link.error = ProtocolError(f"{link.name}: {type(exc).__name__}: {exc}")
            if dp_todo or todo:
                self._kick()
            if self.staging is not None:
                self.staging.pump()  # frees quarantined regions
            if dp_todo or any(l.state is _LinkState.RESOLVING for l in todo):
                time.sleep(_RETRY_S)

    def _expire(self, horizon: float) -> None:
        """Stop resolving what no receiver asked for since ``horizon``."""
        for key in [k for k, v in self.dp_sizes.items() if v == 0 and self._dp_wanted.get(k, 0) < horizon]:
            del self.dp_sizes[key]
            self._dp_wanted.pop(key, None)
        for link in [l for l in self.links.values()
                     if l.state is not _LinkState.READY and l.last_wanted < horizon]:
            self.forget(link)

    def _kick(self) -> None:
        """Advance waiting receivers now, not at their scheduler's next poll,
        so requests reach prefill as soon as the node is resolved."""
        with self.mgr._lock:
            waiting = [r for r in self.receivers.values() if r._state.state is KVPoll.Bootstrapping]
        for r in waiting:
            r.poll()

    def _client(self, addr: str) -> BootstrapClient:
        client = self._clients.get(addr)
        if client is None:
            client = self._clients[addr] = BootstrapClient(addr, timeout_s=self.mgr.config.rpc_timeout_s)
        return client

    def _step(self, link: _Link) -> None:
        addr, node, dp = link.key
        if not link.ranks:
            try:
                reply = self._client(addr).lookup(node, dp)
            except BootstrapUnavailable as exc:
                link.progress = str(exc)
                return
            except BootstrapError as exc:
                raise BootstrapError(f"{self.mgr.where}: looking up {link.name}: {exc}", code=exc.code) from exc
            if not reply.ready:
                link.progress = f"{reply.num_registered} of {reply.tp_size or '?'} prefill ranks registered"
                return
            self._route(link, reply.ranks)
        with self.mgr._lock:
            pending = []
            for p in link.routes:
                session = link.ranks[p].session
                hello = self._hellos.get(session)
                if hello is None:
                    hello = self._hellos[session] = _Hello()
                    self.mgr.channel.send(link.ranks[p].control_endpoint, PeerHello(
                        rank=self.mgr.rank, allow_missing_draft=self.mgr.config.allow_missing_draft))
                if hello.error is not None:
                    raise hello.error
                if not hello.ok:
                    if time.monotonic() - hello.sent_at > self.mgr.config.rpc_timeout_s:
                        del self._hellos[session]
                        raise KVTimeoutError(f"{link.name}: prefill rank {p} at {link.ranks[p].control_endpoint} "
                                             f"did not answer the handshake within {self.mgr.config.rpc_timeout_s:g} s")
                    pending.append(p)
            if pending:
                link.progress = f"waiting for the handshake of prefill ranks {pending}"
            else:
                link.state = _LinkState.READY

    def _route(self, link: _Link, ranks: tuple[RankInfo, ...]) -> None:
        local = self.mgr.rank
        link.ranks = ranks  # known before the check, so a failure can reach every rank
        for r in ranks:
            check_compatible(local, r, local_is_prefill=False,
                             allow_missing_draft=self.mgr.config.allow_missing_draft)
        prefill_tp, decode_tp = ranks[0].tp_size, local.tp_size
        shapes = tuple(
            tp.PoolShape(role=p.role, is_mla=p.attention is AttentionKind.MLA, total_heads=p.total_kv_heads)
            for p in ranks[0].pools if local.pool(p.role) is not None)
        routes = tp.room_routes(local.tp_rank, prefill_tp, decode_tp, shapes)
        link.routes = {
            p: tuple(PoolAssignment(role=role, send=s is not None,
                                    src_head_offset=s.src_head_offset if s else 0,
                                    dst_head_offset=s.dst_head_offset if s else 0,
                                    num_heads=s.num_heads if s else 0)
                     for role, s in by_role.items())
            for p, by_role in routes.items()}
        link.num_requests = {p: tp.num_requests(p, prefill_tp, decode_tp, shapes) for p in routes}
        senders_of_target = [p for p, by_role in routes.items() if by_role.get(PoolRole.TARGET)]
        link.aux_rank = senders_of_target[0]

    def close(self, error: BaseException) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(2.0)
        with self.mgr._lock:
            receivers = list(self.receivers.values())
        for r in receivers:
            r._fail(error)
        for c in self._clients.values():
            c.close()


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
        self._state = RoomState(f"{mgr.where} room {self.room}")
        self._created = time.monotonic()
        self._link: _Link | None = None
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
        if link is not None and link.state is _LinkState.FAILED:
            self.mgr.rooms.forget(link)
            self._link = link
            self._fail(link.error)
            return
        if link is not None and link.state is _LinkState.READY:
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
