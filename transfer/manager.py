"""KVManager: one per rank and role. Wiring: it builds (or is given) the
transport and the control channel, the staging memory and the storage tier,
hands the room layer a :class:`~transfer.rooms.context.RoomContext`, and runs
the liveness and registration threads."""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple, Sequence

import torch

from bootstrap.client import BootstrapClient
from bootstrap.messages import RankInfo, StagingDescriptor
from transfer.changes import ChangeLog
from transfer.config import ManagerConfig, Role, apply_log_level, staging_bytes_for
from transfer.control.base import ChannelFactory, ControlChannel
from transfer.control.zmq_channel import zmq_channel
from transfer.errors import BootstrapError, BootstrapUnavailable, ClosedError, KVFerryError
from transfer.hostmem import host_tensor
from transfer.liveness import Liveness
from transfer.manager_stats import ManagerStatsView
from transfer.manager_threads import _LEARN_EVERY, _SWEEP_INTERVAL_S, ManagerThreads  # noqa: F401
from transfer.messages import PeerBye, PeerPing, PeerPong
from transfer.pools import (MHAPool, MLAPool, RawAuxRegion, aux_tensors, describe_aux, describe_pool, pool_tensors,
                            pools_device, registration_regions)
from transfer.rooms.context import RoomContext
from transfer.rooms.decode_table import DecodeRooms
from transfer.rooms.prefill_table import PrefillRooms
from transfer.staging.area import StagingArea, StagingMemory
from transfer.staging.arenas import StagingArenas, arena_layout, span_tensor
from transfer.stats import ManagerStats, RankTotals
from transfer.storage.tier import StorageTier
from transfer.transport.base import Transport
from transfer.transport.factory import build_transport, transport_kind
from transfer.transport.mooncake import MooncakeTransport, check_engine_build  # noqa: F401  (tests patch it here)

log = logging.getLogger("kvferry.manager")


class PrefillTopology(NamedTuple):
    """A prefill node's parallel sizes, as its ranks registered them."""

    dp_size: int
    tp_size: int


class KVManager(ManagerThreads, ManagerStatsView):
    """One rank's transfer endpoint, prefill or decode (``config.role``).

    Construction registers the pools' memory with the Mooncake engine (a
    fenced decode rank: only its staging arenas, see ``write_fence``), binds
    the control socket, starts the worker threads and, on prefill, registers
    the rank with the bootstrap server (retrying for at most
    ``config.register_timeout_s``, then raising
    :class:`~transfer.errors.BootstrapUnavailable`). Pools are
    :class:`~transfer.pools.MHAPool` / :class:`~transfer.pools.MLAPool`, at
    most one per role (target, draft). ``aux``: the metadata regions, one row
    per request slot, all sharing the slot index: None, one tensor, or a
    sequence of tensors and :class:`~transfer.pools.RawAuxRegion`; each is
    sent as one descriptor per request.

    Threads: the control receiver, the transport worker, the decode
    resolver, and ``kvferry-liveness`` (pings peers of live rooms and fails
    the rooms of a silent one; see :mod:`transfer.liveness`); on prefill also
    ``kvferry-register``, which re-registers every
    ``config.register_interval_s`` so that a restarted bootstrap server is
    re-populated and a dead rank drops out of it.

    ``close()`` stops the threads, unregisters a prefill rank from the
    bootstrap server, fails every live room with ClosedError and tells the
    peers (a prefill rank also says goodbye to its decode peers, which then
    forget their links to it), then closes the transport and the channel;
    the manager is a context manager.

    Seams (for tests, or another engine): ``transport`` is a
    :class:`~transfer.transport.base.Transport` not yet registered (default:
    a :class:`~transfer.transport.mooncake.MooncakeTransport` of
    ``config.engine``); ``channel_factory(host, handler, secret)`` builds the
    :class:`~transfer.control.base.ControlChannel` (default: zmq). The
    manager registers the transport's memory and closes both.

    Observability: :meth:`stats` (totals since start, any time); with
    ``config.metrics_port`` it serves them as Prometheus ``/metrics`` (see
    :mod:`transfer.metrics`); ``config.log_level`` sets the ``kvferry``
    loggers' level.
    """

    def __init__(self, config: ManagerConfig, pools: Sequence[MHAPool | MLAPool],
                 aux: object | Sequence[object | RawAuxRegion] | None = None, *,
                 transport: Transport | None = None, channel_factory: ChannelFactory | None = None) -> None:
        self.config = config
        apply_log_level(config.log_level)
        self._totals = RankTotals(config.role.value)
        self.metrics = None
        # The engine holds raw pointers into these tensors: keep them alive as
        # long as the manager, whatever the caller does with its references.
        #: the aux regions as tensors (empty: none)
        self.aux = aux = aux_tensors(aux)
        self._tensors = (tuple(pools), aux)
        descriptors = tuple(describe_pool(p) for p in pools)
        aux_desc = tuple(describe_aux(t) for t in aux)
        #: the staging tensor (uint8; None without staging; a fenced decode rank's: the span of its arenas,
        #: mostly unbacked virtual memory: fault it in with touch_staging(), never by filling it)
        self.staging, staging_desc, staging_mem = None, None, None
        device_type = pools_device(pools)
        if transport is None and device_type != "cpu" and config.engine.backend == "mooncake":
            check_engine_build(device_type)  # before any allocation: the non-CUDA wheel cannot read HBM
        staging_bytes = staging_bytes_for(config, device_type)
        #: whether peers write only into staging arenas (see ManagerConfig, write fence)
        self.fenced = bool(config.write_fence and staging_bytes and config.role is Role.DECODE)
        arena_bytes = num_arenas = 0
        if staging_bytes:
            buffers = pool_tensors(pools)  # (role, layer, component) -> tensor, for gather and scatter
            device = next(iter(buffers.values())).device
            if self.fenced:
                arena_bytes, num_arenas = arena_layout(staging_bytes, config.stage_part_bytes)
                self.staging = span_tensor(arena_bytes, num_arenas, device)
            elif device.type == "cpu":  # huge pages: the engine's kernel copies run faster (see hostmem);
                # untouched: its pages fault in as parts first use them, not all at start-up.
                self.staging = host_tensor(staging_bytes, fill=None)
            else:
                self.staging = torch.zeros(staging_bytes, dtype=torch.uint8, device=device)
            staging_desc = StagingDescriptor(addr=self.staging.data_ptr(), nbytes=self.staging.numel(),
                                             arena_bytes=arena_bytes)
        self._lock = threading.RLock()
        self._progress = threading.Condition(self._lock)
        self._changes = ChangeLog()
        self._next_sweep = 0.0
        self._closed = False
        self._stop = threading.Event()
        self.liveness = Liveness(config.heartbeat_interval_s, config.peer_timeout_s)
        self._ping_seq = 0
        self._pinged_at: dict[int, float] = {}  # ping seq -> when it was sent (the latest few)
        self.transport: Transport = transport if transport is not None else build_transport(config.engine,
                                                                                                device_type)
        try:
            if self.fenced:  # nothing of the pools is writable by peers: only the arenas (registered by them)
                area = StagingArenas(self.staging, arena_bytes, num_arenas, self._register_arena,
                                     self._unregister_arena)
                staging_mem = StagingMemory(self.staging, area, buffers)
            else:
                regions = registration_regions(pools, aux)  # views of one allocation: registered once
                if staging_desc is not None:
                    regions.append((staging_desc.addr, staging_desc.nbytes))
                    staging_mem = StagingMemory(self.staging, StagingArea(staging_bytes), buffers)
                self.transport.register(regions)
            factory = channel_factory if channel_factory is not None else zmq_channel
            self.channel: ControlChannel = factory(config.host, self._on_message, config.secret or None)
        except BaseException:
            self.transport.close()
            raise
        describe = getattr(self.transport, "describe", None)
        line = describe() if describe is not None else type(self.transport).__name__
        log.log(logging.WARNING if "falls back" in line else logging.INFO, "%s: transport %s; control %s",
                self.where, line, self.channel.endpoint)
        self.rank = RankInfo(
            node_id=config.node_id, dp_rank=config.dp_rank, dp_size=config.dp_size,
            tp_rank=config.tp_rank, tp_size=config.tp_size, session=self.transport.session,
            control_endpoint=self.channel.endpoint, pools=descriptors, aux=aux_desc, staging=staging_desc,
            fenced=self.fenced, transport=transport_kind(self.transport),
        )
        self.storage = None
        if config.storage_url:
            try:
                self.storage = StorageTier(config, pools, aux, self.where)
            except BaseException:
                self.channel.close()
                self.transport.close()
                raise
        #: what the room layer gets of this manager
        self.context = RoomContext(
            config=config, where=self.where, rank=self.rank, lock=self._lock, changed=self._changed,
            transport=self.transport, channel=self.channel, staging=staging_mem, storage=self.storage,
            bootstrap_client=self.bootstrap_client, stats=self._totals, aux=aux)
        #: the room table (prefill or decode)
        self.rooms = PrefillRooms(self.context) if config.role is Role.PREFILL else DecodeRooms(self.context)
        self._threads = [threading.Thread(target=self._watch, name="kvferry-liveness", daemon=True)]
        self._registered = False
        if config.role is Role.PREFILL:
            try:
                self._register()
                self._registered = True
            except BaseException:
                self.close()
                raise
            self._threads.append(threading.Thread(target=self._keep_registered, name="kvferry-register",
                                                  daemon=True))
        if config.metrics_port:
            try:
                from transfer.metrics import serve_metrics
                self.metrics = serve_metrics(self)
            except BaseException:
                self.close()
                raise
        for t in self._threads:
            t.start()

    def _register_arena(self, regions: list[tuple[int, int]]) -> None:
        self.transport.register(regions)
        self._memory_changed()

    def _unregister_arena(self, regions: list[tuple[int, int]]) -> None:
        self.transport.unregister(regions)
        self._memory_changed()

    def _memory_changed(self) -> None:
        """A fenced decode rank's registered memory changed (an arena was
        replaced; called under the lock): a transport whose peers hold its
        metadata (NIXL) tells them at once, before any grant names the new
        arena (see PeerHello)."""
        rooms = getattr(self, "rooms", None)
        if rooms is not None and hasattr(self.transport, "metadata"):
            rooms.links.announce()

    @property
    def where(self) -> str:
        """This rank, for error messages."""
        c = self.config
        return f"{c.role.value} {c.node_id} dp {c.dp_rank} tp {c.tp_rank}/{c.tp_size}"

    def prefill_topology(self, bootstrap_addr: str, node_id: str, *,
                         timeout_s: float | None = None) -> PrefillTopology | None:
        """The DP and TP sizes of prefill node ``node_id`` at the bootstrap
        server ``bootstrap_addr``, once its DP group 0 fully registered; None
        until then (or while the server knows nothing of the node). One
        lookup, blocking at most ``timeout_s`` (default
        ``config.rpc_timeout_s``); raises
        :class:`~transfer.errors.BootstrapUnavailable` when the server does
        not answer in time, :class:`~transfer.errors.BootstrapError` when it
        refuses."""
        timeout = self.config.rpc_timeout_s if timeout_s is None else timeout_s
        with BootstrapClient(bootstrap_addr, timeout_s=timeout, secret=self.config.secret or None) as client:
            reply = client.lookup(node_id, 0)
        if not reply.ready or reply.dp_size < 1:
            return None
        return PrefillTopology(dp_size=reply.dp_size, tp_size=reply.tp_size)

    def bootstrap_client(self, addr: str) -> BootstrapClient:
        return BootstrapClient(addr, timeout_s=self.config.rpc_timeout_s, secret=self.config.secret or None)

    def touch_staging(self) -> None:
        """Fault in the staging memory in use (benchmarks: as a warmed-up
        server has it); of a fenced decode rank's span only the live arenas."""
        mem = self.context.staging
        if mem is not None:
            touch = getattr(mem.area, "touch", None)
            touch() if touch is not None else mem.tensor.fill_(0)

    def _on_message(self, msg, origin: str = "") -> None:
        if isinstance(msg, PeerPing):
            # Answer known peers only, at the endpoint we know them by: a ping
            # cannot make this rank connect anywhere else.
            with self._lock:
                endpoint = self.rooms.endpoint_of(msg.session)
                self.liveness.heard(msg.session, time.monotonic())
                acks = self.rooms.take_acks(msg.session) if endpoint is not None else ()
            if endpoint is not None:
                try:
                    self.channel.send(endpoint, PeerPong(session=self.rank.session, seq=msg.seq, acks=acks))
                except KVFerryError as exc:  # closing, or the peer's queue is full
                    log.debug("%s: pong to %s not sent: %s", self.where, endpoint, exc)
            return
        if isinstance(msg, PeerPong):
            with self._lock:
                self.liveness.heard(msg.session, time.monotonic())
                pinged_at = self._pinged_at.get(msg.seq)
            self.rooms.on_pong(msg.session, msg.acks, pinged_at)
            return
        self.rooms.on_message(msg, origin)

    def _changed(self, room=None, state=None) -> None:
        """``room`` (a sender or receiver; None: some room) changed to
        ``state`` (called with the lock held)."""
        self._changes.record(room, state)
        self._progress.notify_all()

    @property
    def progress(self) -> int:
        """A mark that grows by one whenever any room of this manager changes state."""
        return self._changes.progress

    def changed_rooms(self, since: int) -> tuple[int, list | None]:
        """``(progress, changes)``: the rooms that changed state after the
        mark ``since`` (a ``progress`` value), as ``(room, state)`` pairs
        oldest first (``room`` is the KVSender or KVReceiver; a room may
        appear more than once; ``state`` is what it changed to, call its
        ``poll()`` for what it is now). ``changes`` is None when the caller
        fell more than 65,536 changes behind: poll every room then. Cost:
        O(changes returned); never blocks beyond the manager's lock. Each
        scheduler loop keeps its own mark; nothing is consumed.

        Every state change is in the log, timeouts included: the manager's
        liveness thread polls live rooms every ``_SWEEP_INTERVAL_S``, so a
        scheduler that polls only changed rooms still sees them fail."""
        with self._lock:
            return self._changes.since(since)

    def wait_for_progress(self, seen: int, timeout_s: float) -> int:
        """Block until ``progress`` exceeds ``seen`` or ``timeout_s`` passed;
        returns ``progress``. For scheduler loops that would otherwise
        sleep-poll: ``mark, changed = changed_rooms(mark)``, handle those
        rooms, then ``wait_for_progress(mark, ...)``."""
        with self._progress:
            self._progress.wait_for(lambda: self._changes.progress > seen, timeout_s)
            return self._changes.progress

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.where}: manager is closed")

    def close(self) -> None:
        """Stop threads, unregister (prefill), fail live rooms and tell their
        peers, then close the transport (its outstanding writes fail, and
        their rooms' peers are told) and last the channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        for t in getattr(self, "_threads", ()):
            if t.is_alive():
                t.join(self.config.rpc_timeout_s + 1)
        rooms = getattr(self, "rooms", None)
        prefill = isinstance(rooms, PrefillRooms)
        if getattr(self, "_registered", False):  # leave at once, not at the rank TTL
            self._unregister()
        if rooms is not None:
            rooms.close(ClosedError(f"{self.where}: manager closed"))
        self.transport.close()  # failed writes' callbacks send their rooms' notices on the open channel
        if prefill:
            with self._lock:
                peers = [p.control_endpoint for p in rooms.peers.values()]
            for endpoint in peers:
                try:
                    self.channel.send(endpoint, PeerBye(session=self.rank.session))
                except KVFerryError as exc:
                    log.debug("%s: goodbye to %s not sent: %s", self.where, endpoint, exc)
        self.channel.close()
        if self.storage is not None:
            self.storage.close()
        if self.metrics is not None:
            self.metrics.close()

    def __enter__(self) -> "KVManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

