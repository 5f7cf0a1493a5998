"""The worker half of kvferry's vLLM connector: one KVManager per vLLM worker.

Imported only in vLLM's worker processes (it pulls in torch, zmq and the
Mooncake engine). vLLM calls, on its model-runner thread:
``register_kv_caches`` once, then every engine step ``start`` (the step's
sends and receives), ``finished`` (what completed since the last call),
``load_errors`` or ``failed_receives`` (the receives among them that failed:
by block with one KV-cache group, by request id with several) and
``take_stats`` (the rooms that ended since the last call).

A driver thread (``kvferry-vllm``) waits for the manager's progress and
polls only the rooms that changed (``KVManager.changed_rooms``): the work
per wake-up is proportional to the rooms that changed, not to the rooms
open. It pushes a prefill room's pages as soon as its decode request
arrived, so no push waits for the next engine step. Time bounds need no
polling here: the manager's liveness thread polls every live room twice a
second, so a room that times out (or whose peer went silent) changes state
and reaches the driver like any other change. The prefill lease is the
driver's own bound, kept in a heap of deadlines (only the earliest is
looked at per wake-up). ``start`` polls the rooms it opened once (a decode
request may have come first; a change before the room was listed would be
missed). With vLLM's in-process executor the scheduler half calls
``start`` too, from the scheduler's thread, as soon as a room is known
(``transfer.adapters.vllm._LOCAL_WORKERS``): ``start`` and the pollers take
the worker's lock, so any thread may call it. Nothing blocks vLLM: ``start`` submits, ``finished`` and
``take_stats`` only take a lock.

Every TP rank has its own worker and KVManager, registered with its TP rank
and size and holding its slice of the KV heads (:class:`CacheLayout` gives
the model's head count and vLLM's layout); prefill and decode TP sizes may
differ wherever one divides the other, and kvferry plans the head slices.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from dataclasses import dataclass, replace

from bootstrap.messages import PoolRole
from transfer.adapters import vllm_stats
from transfer.adapters.vllm_groups import Group, GroupPlan, split_draft
from transfer.adapters.vllm_groups import layer_order as _layer_order
from transfer.adapters.vllm_layerwise import LayerStream, layer_groups
from transfer.adapters.vllm_params import ConnectorConfig, RecvSpec, SendSpec, query_reply
from transfer.adapters.vllm_query import KvferryAddresses, QueryServer
from transfer.config import EngineConfig, ManagerConfig, Role
from transfer.errors import KVFerryError
from transfer.pools import FusedKVPool, MLAPool, describe_fused
from transfer.state import KVPoll
from transfer.stats import failure_reason

log = logging.getLogger("kvferry.vllm")

_WAKE_S = 0.05  # the driver's longest sleep (its stop flag and the lease deadlines)
_FIRST_HOLD_S = 1.0  # decode: a queued request's first RoomHold goes out this long after it came
_HOLD_RETRY_S = 0.2  # decode: a hold not sent (its prefill node being looked up) is tried again this soon


@dataclass(frozen=True)
class CacheLayout:
    """What the connector knows of vLLM's KV cache beyond the tensors:
    ``total_kv_heads`` (the model's; None: this rank's, right for TP 1),
    ``kv_layout`` (``fused_rows`` on vLLM's CPU backend, ``fused_cells`` on
    the GPU backends) and ``vllm_layout`` (vLLM's resolved KVCacheLayout
    name, checked against the tensors' strides when given)."""

    total_kv_heads: int | None = None
    kv_layout: str = "fused_rows"
    vllm_layout: str | None = None
    mla: bool = False  # one latent tensor per layer (DeepSeek-style MLA)
    block_size: int | None = None  # vLLM's logical block (the scheduler's block ids); None: the tensors'
    #: with a speculative draft: the target model's layers (later ones and ``draft_model.*`` are the draft's)
    target_layers: int | None = None
    draft_kv_heads: int | None = None  # the draft model's KV heads (its pool's ``total_kv_heads``)


def mla_layers(layers: list, block_size: int | None) -> list:
    """vLLM's MLA caches as kvferry's latent pages of the scheduler's
    (logical) block: each ``[kernel_blocks, kernel_block, latent]`` tensor
    (with a head dimension of 1 before or after the tokens, as vLLM's CPU and
    GPU MLA backends shape it) viewed as ``[blocks, block_size, latent]``. vLLM splits a logical
    block into ``block_size / kernel_block`` consecutive kernel blocks (the
    CPU MLA backend's kernel block is 16), so logical block b is rows
    ``b * block_size ...`` of the same memory: a view, no copy."""
    out = []
    for i, t in enumerate(layers):
        if t.dim() == 4 and 1 in (t.shape[1], t.shape[2]):  # one latent "head", before or after the tokens
            t = t.select(1 if t.shape[1] == 1 else 2, 0)
        if t.dim() != 3 or not t.is_contiguous():
            raise ValueError(f"kvferry vLLM worker: MLA layer {i}: expected a contiguous [blocks, block_size, "
                             f"latent] cache, got shape {tuple(t.shape)} strides {t.stride()}")
        kernel = int(t.shape[1])
        size = block_size or kernel
        if size % kernel or (t.shape[0] * kernel) % size:
            raise ValueError(f"kvferry vLLM worker: MLA layer {i}: logical block size {size} is not a whole "
                             f"number of kernel blocks of {kernel} tokens ({t.shape[0]} kernel blocks)")
        out.append(t.view(t.shape[0] * kernel // size, size, t.shape[2]))
    return out


def group_state_pool(group: Group, layers: list, mla: bool):
    """A KV-cache group beside the main one (HMA) as a page-indexed state
    pool: one buffer per layer, a block of the group one item (K and V of
    this rank's heads). MHA is sharded by heads (the item's head axis is
    its slice axis, so prefill and decode TP may differ); MLA's latent is
    the same on every rank (replicated)."""
    from transfer.state_pools import StatePool

    if group.kind == "mamba":
        return mamba_state_pool(group, layers)
    buffers, slicing = [], []
    for i, t in enumerate(layers):
        if t.dim() != 4 or not t.is_contiguous():
            raise ValueError(f"kvferry vLLM worker: KV-cache group {group.index} layer {i} ({group.layers[i]}): "
                             f"expected a contiguous [blocks, heads, block_size, width] cache, got shape "
                             f"{tuple(t.shape)} strides {t.stride()}")
        heads = int(t.shape[1])
        buffers.append(t.view(t.shape[0], -1))  # a block per row: a view
        slicing.append(None if mla else (heads, 1, ()))  # [B, H, N, C]: this rank's heads outermost
    return StatePool(kind=f"vllm-group{group.index}", buffers=tuple(buffers),
                     sharding="replicated" if mla else "sharded", exact=False, slicing=tuple(slicing))


def mamba_state_pool(group: Group, layers: list):
    """A Mamba/GDN group as a slot state pool: per layer, a buffer of its
    blocks, a block (the request's conv and SSM state, vLLM's padded page)
    one item. vLLM hands each layer a view of its pages (``[blocks, ...]``,
    a block's stride the padded page); kvferry takes the whole page, a view
    of the same memory. Sharded by TP rank without a slice axis: prefill and
    decode TP must be equal (the handshake refuses others by name)."""
    import torch

    from transfer.state_pools import StatePool

    buffers = []
    for i, t in enumerate(layers):
        if isinstance(t, (list, tuple)):  # per-state views: the page starts at the first one
            t = t[0]
        page = t.stride(0) * t.element_size() if t.dim() else 0
        if t.dim() < 2 or page < t[0].numel() * t.element_size() or not t[0].is_contiguous():
            raise ValueError(f"kvferry vLLM worker: Mamba group {group.index} layer {i} ({group.layers[i]}): "
                             f"expected [blocks, ...] with contiguous blocks, got shape {tuple(t.shape)} strides "
                             f"{t.stride()}")
        rows = torch.empty(0, dtype=torch.uint8, device=t.device)  # the same memory, a page per row
        rows.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (t.shape[0], page), (page, 1))
        buffers.append(rows)
    return StatePool(kind=f"vllm-group{group.index}", buffers=tuple(buffers), sharding="sharded", exact=True)


def _written(r: RecvSpec) -> list[int]:
    """The blocks a decode room writes (its load errors if it fails): the
    pages after the prefix cache's, and every wanted state block."""
    return list(r.pages[r.skip_pages:]) + [b for items in r.states for b in items if b >= 0]


def check_block_size(page_size: int, block_size: int | None) -> None:
    """vLLM's block ids name logical blocks; a fused K/V cache whose kernel
    block differs (its pages are not one logical block each) would move the
    wrong tokens: refused."""
    if block_size is not None and page_size != block_size:
        raise ValueError(f"kvferry vLLM worker: the KV cache's kernel block holds {page_size} tokens and vLLM's "
                         f"logical block {block_size}: kvferry moves whole logical blocks of MHA caches only where "
                         f"the two are equal (set --block-size {page_size})")


def _written_event(kv_layer):
    """A CUDA event recorded now on the current stream, after the layer's
    KV writes vLLM launched (None on the CPU: written already)."""
    if isinstance(kv_layer, (list, tuple)):  # a backend's per-layer K and V
        kv_layer = kv_layer[0] if kv_layer else None
    if not getattr(kv_layer, "is_cuda", False):
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


@dataclass
class _Room:
    req_id: str
    handle: object  # KVSender or KVReceiver
    pages: tuple[int, ...]
    states: tuple[tuple[int, ...], ...] = ()  # prefill: per state pool (HMA's other groups), its items
    pushed: bool = False
    aborted: bool = False  # by vLLM: its blocks are no one's load errors
    expired: bool = False  # prefill: its lease ran out before a decode asked
    stream: LayerStream | None = None  # prefill, layer-wise: its layer groups (vllm_layerwise)
    ready: object = None  # prefill, layer-wise on CUDA: the event of the latest layer the forward wrote


@dataclass
class _Hold:
    """Decode: a queued request's room, held at prefill until it is scheduled or cancelled."""

    spec: object  # its RecvSpec
    due: float  # when the next RoomHold goes (time.monotonic())


class KvferryWorker:
    """Sends (prefill) or receives (decode) rooms for one vLLM worker rank."""

    #: decode: a queued request's room is held at prefill this long (RoomHold) ...
    hold_s = 20.0
    #: ... renewed this often until the request is scheduled (its room opens) or dropped
    hold_every_s = 5.0

    def __init__(self, config: ConnectorConfig, *, role: Role, tp_rank: int, tp_size: int,
                 layout: CacheLayout | None = None, groups: GroupPlan | None = None) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"kvferry vLLM worker: tp_rank {tp_rank} not in [0, {tp_size})")
        self.config, self.role, self.tp_rank, self.tp_size = config, role, tp_rank, tp_size
        self.layout = layout or CacheLayout()
        self.groups = groups  # vLLM's KV-cache groups (None: every layer in one)
        self.mgr = None
        self.server = None  # kvferry's ZMQ bootstrap server (kvferry_serve_bootstrap)
        self.query: list = []  # prefill: the HTTP ports (GET /query for vLLM's Mooncake routers)
        self.discovery = None  # TP rank 0: registration with vllm-router (kvferry_router_discovery)
        self._kvferry_addr = KvferryAddresses()  # decode: a request's bootstrap address -> kvferry's ZMQ server
        self._lock = threading.Lock()
        self._rooms: dict[str, _Room] = {}
        self._by_handle: dict[int, _Room] = {}  # id(handle) of every listed room (it keeps the handle alive)
        self._leases: list[tuple[float, str]] = []  # prefill: (deadline, req_id), a heap
        self._layer_index: dict[str, int] = {}  # vLLM layer name -> room layer (target's, then the draft's)
        self._stream_groups: tuple[range, ...] = ()  # prefill, layer-wise: the room layers of each group
        self._streaming: dict[str, _Room] = {}  # prefill: layer-wise rooms with groups not yet sent
        self._streamed: set[str] = set()  # prefill: requests opened layer-wise whose SendSpec has not come yet
        self._stats = vllm_stats.empty()  # rooms ended since the last take_stats()
        self.num_polled = 0  # room polls by this worker (tests: proportional to changes)
        self._done: set[str] = set()  # finished (either way), not yet reported
        self._finished_seen: set[str] = set()  # request ids vLLM called finished (sends may be reported)
        self._load_errors: set[int] = set()  # decode, one KV-cache group: the blocks of failed receives
        self._failed_recvs: set[str] = set()  # decode, several groups: the failed receives' request ids
        self._failed_out: set[str] = set()  # those of them finished() has reported
        # vLLM maps block-level load errors back to requests only where block ids are unique, one KV-cache
        # group; with several (HMA) it takes failed receives by request id and raises on block ids
        self._fail_by_request = groups is not None and groups.num_groups > 1
        self.num_failed = 0
        self.num_cancelled = 0  # decode requests prefill was told of before they had a room
        self._holds: dict[str, _Hold] = {}  # decode: req_id -> its hold, for queued requests
        self.num_holds = 0  # decode: RoomHolds sent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- vLLM's calls ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        """Describe vLLM's per-layer caches as one fused K/V pool (this rank's
        heads of ``layout.total_kv_heads``), each other KV-cache group (HMA)
        as a state pool, and build the manager."""
        from transfer.manager import KVManager  # lazily: Mooncake and zmq load here only

        plan = self.groups
        lay = self.layout
        names, draft_names = split_draft(sorted(kv_caches if plan is None else plan.main.layers, key=_layer_order),
                                         lay.target_layers)
        layers = [kv_caches[name] for name in names]
        self.index_layers(names, draft_names)
        states = [] if plan is None else \
            [group_state_pool(g, [kv_caches[n] for n in g.layers], lay.mla) for g in plan.states]
        pools = [self._pool(layers, PoolRole.TARGET, lay.total_kv_heads)]
        if draft_names:  # a speculative draft's own KV: kvferry's draft pool, checked on its own
            pools.append(self._pool([kv_caches[n] for n in draft_names], PoolRole.DRAFT,
                                    lay.draft_kv_heads or lay.total_kv_heads))
        c = self.config
        if self.role is Role.PREFILL and self.tp_rank == 0:
            self._serve()
        mconfig = ManagerConfig(role=self.role, bootstrap_addr=c.kvferry_addr, node_id=c.node_id,
                                host=c.host, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                engine=replace(EngineConfig(), protocol=c.protocol, hostname=c.host),
                                **c.manager_fields(prefill=self.role is Role.PREFILL))
        try:
            self.attach(KVManager(mconfig, pools, states=states))
        except BaseException:
            self._close_servers()
            raise
        if c.router_discovery and self.tp_rank == 0:  # once this rank can take rooms
            from transfer.control.router_discovery import DiscoveryHeartbeat
            self.discovery = DiscoveryHeartbeat(c.router_discovery, {
                "type": "P" if self.role is Role.PREFILL else "D", "http_address": c.http_address,
                "zmq_address": c.kvferry_addr, "dp_size": 1, "tp_size": self.tp_size})
        log.info("kvferry %s worker (TP rank %d of %d): %d layers (%d of a draft), %d blocks of %d bytes per layer, "
                 "%s, %d state pool(s), bootstrap %s", self.role.value, self.tp_rank, self.tp_size, len(layers),
                 len(draft_names), layers[0].shape[0],
                 layers[0][0].numel() * layers[0].element_size(), lay.vllm_layout or lay.kv_layout, len(states),
                 c.kvferry_addr)

    def _serve(self) -> None:
        """Prefill's TP rank 0: kvferry's ZMQ bootstrap server
        (``kvferry_serve_bootstrap``) and the HTTP ports vLLM's Mooncake
        routers ask (:mod:`~transfer.adapters.vllm_query`): the served
        bootstrap port itself, and ``kvferry_query_port``."""
        c = self.config
        try:
            if c.serve_bootstrap:
                from bootstrap.server import BootstrapServer
                host, _, port = c.kvferry_addr.rpartition(":")
                self.server = BootstrapServer(host, int(port)).start()
            served = int(c.bootstrap_addr.rpartition(":")[2]) if c.serve_bootstrap else None
            zmq_port = int(c.kvferry_addr.rpartition(":")[2])
            for port in c.http_ports:  # the served port on the bootstrap's host, kvferry_query_port on ours
                host = c.bootstrap_addr.rpartition(":")[0] if port == served else c.host
                self.query.append(QueryServer(host, port, query_reply(c, self.tp_size), zmq_port))
        except BaseException:
            self._close_servers()
            raise
        if c.serve_bootstrap:
            log.info("kvferry bootstrap: HTTP (GET /query, /kvferry) on %s, kvferry's ZMQ server on %s",
                     ", ".join(q.address for q in self.query), self.server.address)

    def _pool(self, layers: list, role: PoolRole, total_kv_heads: int | None):
        """One pool of vLLM's layers: MLA's latent (identical on every TP
        rank: one prefill rank sends it, the selective send) or fused K/V."""
        lay = self.layout
        if lay.mla:
            return MLAPool(latent=mla_layers(layers, lay.block_size), role=role)
        pool = FusedKVPool(kv=layers, role=role, total_kv_heads=total_kv_heads, kv_layout=lay.kv_layout,
                           vllm_layout=lay.vllm_layout)
        check_block_size(describe_fused(pool).page_size, lay.block_size)
        return pool

    def attach(self, mgr) -> None:
        """Work through ``mgr`` (register_kv_caches builds it; a test may
        give its own) and start the driver thread."""
        self.mgr = mgr
        self._thread = threading.Thread(target=self._drive, args=(mgr.progress,), name="kvferry-vllm",
                                        daemon=True)
        self._thread.start()

    def start(self, sends: list[SendSpec], recvs: list[RecvSpec], aborts: list[str] = (),
              cancels: list[RecvSpec] = (), holds: list[RecvSpec] = ()) -> None:
        """Open this step's rooms, abort the decode rooms of ``aborts``
        (requests vLLM finished while their KV was coming), tell prefill
        of ``cancels`` (decode requests vLLM finished before they had a room:
        prefill frees their blocks now, not at its lease), and hold the rooms
        of ``holds`` at prefill (decode requests queued, not scheduled yet:
        prefill keeps their blocks past its lease, renewed until they are
        scheduled or cancelled). A room that cannot open is reported done
        (and, on decode, its blocks as load errors) at the next ``finished``."""
        if holds or self._holds:
            first = time.monotonic() + min(_FIRST_HOLD_S, self.hold_every_s)
            with self._lock:  # a request scheduled at once needs no hold: the first goes out a bit later
                for h in holds:
                    self._holds[h.req_id] = _Hold(h, first)
                for r in (*recvs, *cancels):
                    self._holds.pop(r.req_id, None)
        if cancels:
            self._cancel(cancels)
        for req_id in aborts:
            with self._lock:
                room = self._rooms.get(req_id)
                if room is not None:
                    room.aborted = True
                    self._streaming.pop(req_id, None)
            if room is not None:
                room.handle.abort("the request finished on decode before its KV arrived" if self.role is Role.DECODE
                                  else "the request was aborted on prefill while its KV was streaming")
        from transfer.rooms.receiver import KVReceiver
        from transfer.rooms.sender import KVSender

        opened: list[_Room] = []
        for s in sends:
            with self._lock:
                streamed = s.req_id in self._streamed  # its room opened for the forward pass (open_streams)
                self._streamed.discard(s.req_id)
                room = self._rooms.get(s.req_id) if streamed else None
                if room is not None:
                    room.stream.finish_all()  # the request finished: all its KV is written (the step synced)
                    room.ready = None
                    heapq.heappush(self._leases, (time.monotonic() + self.config.lease_s, s.req_id))
            if streamed:
                if room is not None:  # (else it ended already, and finished() reports it)
                    opened.append(room)  # polled below: pushes what decode may take now
                continue
            try:
                sender = KVSender(self.mgr, None, s.room)
                sender.init(len(s.pages), token_ids=list(s.token_ids) or None)
            except KVFerryError as exc:
                log.warning("kvferry: request %s (room %d) not sent: %s", s.req_id, s.room, exc)
                with self._lock:
                    self._done.add(s.req_id)
                    vllm_stats.record_failure(self._stats, failure_reason(exc).value)
                continue
            opened.append(self._list(_Room(s.req_id, sender, s.pages, s.states)))
            with self._lock:
                heapq.heappush(self._leases, (time.monotonic() + self.config.lease_s, s.req_id))
        for r in recvs:
            try:
                receiver = KVReceiver(self.mgr, self._kvferry_addr(r.bootstrap_addr), r.room, prefill_node=r.node_id)
                receiver.init(r.pages, token_ids=list(r.token_ids) or None, skip_pages=r.skip_pages,
                              state_indices=list(r.states) or None)
            except KVFerryError as exc:
                log.warning("kvferry: request %s (room %d) not received: %s", r.req_id, r.room, exc)
                with self._lock:
                    self._done.add(r.req_id)
                    self._load_failed(r.req_id, _written(r))
                    vllm_stats.record_failure(self._stats, failure_reason(exc).value)
                continue
            # its load errors, if it fails: the blocks it writes (never the prefix cache's)
            opened.append(self._list(_Room(r.req_id, receiver, tuple(_written(r)))))
        if opened:  # a decode request may have come first (concurrent protocol): push now
            try:
                self._poll(opened)
            except Exception:  # never into vLLM's step; the manager's sweep and the driver go on
                log.exception("kvferry: poll after opening rooms failed")

    def index_layers(self, names: list[str], draft_names: list[str] = ()) -> None:
        """The room's layers by vLLM layer name (the target's in forward
        order, then a draft's) and, layer-wise, their groups."""
        self._layer_index = {name: i for i, name in enumerate([*names, *draft_names])}
        if self.config.layer_groups and self.role is Role.PREFILL:
            self._stream_groups = layer_groups(len(names), len(draft_names), self.config.layer_groups)

    def open_streams(self, streams: list[SendSpec]) -> None:
        """Prefill, layer-wise: open the rooms of the requests whose prefill
        completes in this step, before its forward pass writes their last
        KV; ``layer_saved`` then sends each layer group as it completes (and
        decode asked). The request's ``SendSpec`` (from ``request_finished``)
        finishes every layer and starts the lease."""
        from transfer.rooms.sender import KVSender

        opened = []
        for s in streams:
            try:
                sender = KVSender(self.mgr, None, s.room)
                sender.init(len(s.pages), token_ids=list(s.token_ids) or None)
            except KVFerryError as exc:
                log.warning("kvferry: request %s (room %d) not streamed: %s", s.req_id, s.room, exc)
                continue  # its SendSpec, at the step's end, opens it whole
            room = self._list(_Room(s.req_id, sender, s.pages, stream=LayerStream(self._stream_groups)))
            with self._lock:
                self._streamed.add(s.req_id)
                self._streaming[s.req_id] = room
            opened.append(room)
        if opened:
            self._poll(opened)

    def layer_saved(self, layer_name: str, kv_layer) -> None:
        """vLLM wrote ``layer_name``'s KV of this step (on CUDA: launched;
        an event recorded now on the current stream marks it written)."""
        if not self._streaming:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        ready = _written_event(kv_layer)
        with self._lock:
            rooms = list(self._streaming.values())
            for room in rooms:
                room.stream.finish(layer)
                room.ready = ready if ready is not None else room.ready
        for room in rooms:
            self._push_layers(room, in_forward=True)

    def _push_layers(self, room: _Room, *, in_forward: bool = False) -> None:
        """Send a layer-wise room's completed groups no one sent yet, once its
        decode asked (any thread: the groups are claimed under the lock)."""
        if room.handle.poll() not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            return
        with self._lock:
            groups, ready = room.stream.claim(in_forward=in_forward), room.ready
            if groups:
                room.pushed = True
            if room.stream.done:
                self._streaming.pop(room.req_id, None)
        for group in groups:
            room.handle.send(list(room.pages), last=True, layers=group, ready=ready)

    def _cancel(self, cancels: list[RecvSpec]) -> None:
        """A receiver aborted before its first poll: the room table looks the
        prefill node up and sends the abort once it is known (within
        ``bootstrap_timeout_s``); nothing of it is listed or reported."""
        from transfer.rooms.receiver import KVReceiver

        for c in cancels:
            try:
                KVReceiver(self.mgr, self._kvferry_addr(c.bootstrap_addr), c.room, prefill_node=c.node_id).abort(
                    f"decode does not need request {c.req_id}'s KV (finished before it was scheduled, or its "
                    "own prefix cache holds the prompt)")
                self.num_cancelled += 1
            except KVFerryError as exc:
                log.warning("kvferry: prefill not told that request %s (room %d) was cancelled: %s", c.req_id,
                            c.room, exc)

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(sends done, receives done) since the last call; failed receives
        are among them, their blocks in ``load_errors()``."""
        with self._lock:
            self._finished_seen |= finished_req_ids
            if self.role is Role.PREFILL:
                done = self._done & self._finished_seen
                self._done -= done
                self._finished_seen -= done
                return done, set()
            done, self._done = self._done, set()
            self._failed_out |= self._failed_recvs & done  # failed and reported finished: for failed_receives()
            self._failed_recvs -= done
            return set(), done

    def take_stats(self) -> dict | None:
        """The rooms that ended since the last call (a
        :mod:`~transfer.adapters.vllm_stats` payload), or None: none did."""
        with self._lock:
            if vllm_stats.is_empty(self._stats):
                return None
            data, self._stats = self._stats, vllm_stats.empty()
            return data

    def _load_failed(self, req_id: str, blocks) -> None:
        """A receive failed (the lock held): its blocks are load errors, or,
        with several KV-cache groups, its request id a failed receive."""
        if self._fail_by_request:
            self._failed_recvs.add(req_id)
        else:
            self._load_errors.update(blocks)

    def load_errors(self) -> set[int]:
        """The blocks of receives that failed since the last call (one KV-cache group)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
            return errors

    def failed_receives(self) -> set[str]:
        """The request ids of receives that failed, among those ``finished``
        reported since the last call (several KV-cache groups)."""
        with self._lock:
            failed, self._failed_out = self._failed_out, set()
            return failed

    def num_pending(self) -> int:
        with self._lock:
            return len(self._rooms)

    def release_memory(self) -> None:
        """vLLM's sleep mode is about to free or remap the KV cache
        (``unregister_kv_caches``, vLLM 0.33): every live room fails (decode:
        its blocks reported as load errors; its peers told), kvferry waits
        until no write reads or may still land in the blocks, then takes
        them back from the transport (:meth:`KVManager.release_memory`);
        until :meth:`resume_memory` a new room fails at once. Idempotent; a
        no-op before ``register_kv_caches``. Raises KVTimeoutError while a
        write is still in flight at ``transfer_timeout_s``: the memory must
        not be freed then."""
        if self.mgr is not None:
            self.mgr.release_memory()

    def resume_memory(self) -> None:
        """vLLM woke up with the KV cache at the same addresses
        (``restore_kv_caches``): register it again and take rooms again.
        Idempotent."""
        if self.mgr is not None:
            self.mgr.resume_memory()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self.mgr is not None:
            self.mgr.close()
        self._close_servers()

    def _close_servers(self) -> None:
        for server in (self.discovery, self.server, *self.query):
            if server is not None:
                server.close()
        self.discovery, self.server, self.query = None, None, []

    # --- the driver ----------------------------------------------------------------

    def _list(self, room: _Room) -> _Room:
        with self._lock:
            self._rooms[room.req_id] = room
            self._by_handle[id(room.handle)] = room
        return room

    def _drive(self, mark: int) -> None:
        """Wait for progress; poll the rooms that changed after ``mark`` (all
        of them when the change log says the driver fell behind); end the
        prefill rooms whose lease ran out."""
        while not self._stop.is_set():
            try:
                wait = self._expire_leases()
                if self._holds:
                    wait = min(wait, self._renew_holds())
                self.mgr.wait_for_progress(mark, wait)
                mark, changed = self.mgr.changed_rooms(mark)
                with self._lock:
                    if changed is None:
                        rooms = list(self._rooms.values())
                    else:  # a listed handle is alive, so its id names no other object
                        found = (self._by_handle.get(id(handle)) for handle, _ in changed)
                        rooms = list({id(r): r for r in found if r is not None}.values())
                self._poll(rooms)
            except Exception:  # the driver must outlive any one round
                log.exception("kvferry: poll round failed")
                self._stop.wait(_WAKE_S)

    def _expire_leases(self) -> float:
        """End the prefill rooms no decode asked for within the lease (still
        Bootstrapping at their deadline); returns the seconds to wait for."""
        now, expired = time.monotonic(), []
        with self._lock:
            while self._leases and self._leases[0][0] <= now:
                _, req_id = heapq.heappop(self._leases)
                room = self._rooms.get(req_id)
                if room is not None and not room.pushed:
                    expired.append(room)
            wait = min(_WAKE_S, self._leases[0][0] - now) if self._leases else _WAKE_S
        for room in expired:
            held, state = room.handle.held_until, room.handle.poll()
            if state is KVPoll.Bootstrapping and held > now:
                with self._lock:  # decode holds it (its request queued there): look again then
                    heapq.heappush(self._leases, (held, room.req_id))
            elif state is KVPoll.Bootstrapping:
                room.expired = True
                room.handle.abort(f"lease expired: no decode asked for request {room.req_id} within "
                                  f"{self.config.lease_s:g} s (kvferry_lease_s)")
            else:  # a decode asked: push it now if no poll did (a change missed by a failed round)
                self._poll([room])
        return max(0.0, wait)

    def _renew_holds(self) -> float:
        """Decode: send the RoomHolds that are due (``hold_every_s`` apart
        per request, sooner while its prefill node is looked up); returns
        the seconds until the next one is due."""
        now = time.monotonic()
        with self._lock:
            due = [h for h in self._holds.values() if h.due <= now]
        for h in due:
            spec = h.spec
            try:
                sent = self.mgr.hold_room(self._kvferry_addr(spec.bootstrap_addr), spec.room, prefill_node=spec.node_id,
                                          hold_s=self.hold_s)
            except KVFerryError as exc:
                log.warning("kvferry: request %s (room %d) not held at prefill: %s", spec.req_id, spec.room, exc)
                sent = False
            self.num_holds += sent
            h.due = now + (self.hold_every_s if sent else min(self.hold_every_s, _HOLD_RETRY_S))
        with self._lock:
            return max(0.0, min((h.due for h in self._holds.values()), default=_WAKE_S) - now)

    def _poll(self, rooms: list[_Room]) -> None:
        """Poll ``rooms``: push a prefill room whose decode asked, report the ended ones."""
        self.num_polled += len(rooms)
        for room in rooms:
            state = room.handle.poll()
            if room.stream is not None:
                if state in (KVPoll.WaitingForInput, KVPoll.Transferring):
                    self._push_layers(room)
                    state = room.handle.poll()
            elif self.role is Role.PREFILL and state is KVPoll.WaitingForInput:
                with self._lock:  # two pollers (the driver, and start()): one push
                    push, room.pushed = not room.pushed, True
                if push:
                    room.handle.send(list(room.pages), last=True, state_indices=list(room.states) or None)
                    state = room.handle.poll()
            if state not in (KVPoll.Success, KVPoll.Failed):
                continue
            stats = room.handle.stats()
            with self._lock:
                if self._rooms.pop(room.req_id, None) is None:
                    continue  # the other poller reported it
                del self._by_handle[id(room.handle)]
                self._streaming.pop(room.req_id, None)
                if room.stream is not None:
                    vllm_stats.record_layer_groups(self._stats, room.stream.in_forward,
                                                   len(room.stream.claimed) - room.stream.in_forward)
                self._done.add(room.req_id)
                vllm_stats.record_room(self._stats, stats, reason=vllm_stats.LEASE_EXPIRED if room.expired else None)
                if state is KVPoll.Failed:
                    self.num_failed += 1
                    if self.role is Role.DECODE and not room.aborted:
                        self._load_failed(room.req_id, room.pages)
            if state is KVPoll.Failed:
                try:
                    room.handle.failure_exception()
                except KVFerryError as exc:
                    log.warning("kvferry: request %s failed: %s", room.req_id, exc)
