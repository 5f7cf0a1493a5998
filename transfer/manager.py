"""KVManager: one per rank and role. Wiring only: it builds (or is given) the
transport and the control channel, its staging memory
(:mod:`transfer.staging.build`) and storage tier, hands the room layer a
:class:`~transfer.rooms.context.RoomContext`, and runs the rank's
registration and peer watch (:mod:`transfer.rank`). Its collaborators: the
memory registered with the transport and the scheduler's release of it
(:mod:`transfer.rank_memory`), the room changes scheduler loops read
(:mod:`transfer.change_feed`), a prefill node's topology
(:mod:`transfer.prefill_topology`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from bootstrap import codec
from bootstrap.client import BootstrapClient
from bootstrap.messages import RankInfo
from transfer.change_feed import ChangeFeed
from transfer.config import ManagerConfig, Role, apply_log_level
from transfer.control.base import ChannelFactory, ChannelOptions, ControlChannel
from transfer.control.zmq_channel import zmq_channel
from transfer.errors import ClosedError, KVFerryError, StateError
from transfer.messages import PeerBye, PeerPing, PeerPong
from transfer.prefill_topology import PrefillTopology, lookup_topology
from transfer.pools import MHAPool, MLAPool, RawAuxRegion, aux_tensors, describe_aux, describe_pool, pools_device
from transfer.rank.registration import Registration
from transfer.rank_memory import ArenaRegistration, MemoryRelease, register_pools
from transfer.rank.watch import PeerWatch
from transfer.rooms.context import RoomContext
from transfer.rooms.decode_table import DecodeRooms
from transfer.rooms.prefill_table import PrefillRooms
from transfer.round_times import RoundLock
from transfer.staging.build import build_staging
from transfer.state_pools import StatePool, describe_state
from transfer.stats import ManagerStats, RankTotals
from transfer.storage.tier import StorageTier
from transfer.transport.base import Transport
from transfer.transport.factory import build_transport

log = logging.getLogger("kvferry.manager")

#: A scheduler polling many rooms in a row pumps once for them (see KVManager.pump).
PUMP_INTERVAL_S = 200e-6


class KVManager:
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
    sent as one descriptor per request. ``states``: per-request state pools
    (:class:`~transfer.state_pools.StatePool`: Mamba slots, sliding-window
    pages...), moved with a room's last chunk by the item indices each
    request names (``KVSender.send(state_indices=)``, ``KVReceiver.init(state_indices=)``).

    Threads: the control receiver, the transport worker, the decode
    resolver, and ``kvferry-liveness`` (:mod:`transfer.rank.watch`: pings
    peers of live rooms and fails the rooms of a silent one); on prefill also
    ``kvferry-register`` (:mod:`transfer.rank.registration`), which
    re-registers every ``config.register_interval_s`` so that a restarted
    bootstrap server is re-populated and a dead rank drops out of it.

    ``close()`` stops the threads, unregisters a prefill rank from the
    bootstrap server, fails every live room with ClosedError and tells the
    peers (a prefill rank also says goodbye to its decode peers, which then
    forget their links to it), then closes the transport and the channel;
    the manager is a context manager.

    Seams (for tests, or another engine): ``transport`` is a
    :class:`~transfer.transport.base.Transport` not yet registered (default:
    the one :func:`~transfer.transport.factory.build_transport` builds for
    ``config.engine``); ``channel_factory(options, handler)`` builds the
    :class:`~transfer.control.base.ControlChannel` (default: zmq). The
    manager registers the transport's memory and closes both.

    Observability: :meth:`stats` (totals since start, any time); with
    ``config.metrics_port`` it serves them as Prometheus ``/metrics`` (see
    :mod:`transfer.rank.metrics`); ``config.log_level`` sets the ``kvferry``
    loggers' level.
    """

    def __init__(self, config: ManagerConfig, pools: Sequence[MHAPool | MLAPool],
                 aux: object | Sequence[object | RawAuxRegion] | None = None, *,
                 transport: Transport | None = None, channel_factory: ChannelFactory | None = None,
                 states: Sequence[StatePool] = ()) -> None:
        self.config = config
        apply_log_level(config.log_level)
        self._totals = RankTotals(config.role.value)
        codec.prepare()  # each message kind's plan made here, not by its first message in a background round
        self.metrics = None
        self._closed = False
        # The engine holds raw pointers into these tensors: keep them alive as
        # long as the manager, whatever the caller does with its references.
        #: the aux regions as tensors (empty: none)
        self.aux = aux = aux_tensors(aux)
        self.states = states = tuple(states)
        self._tensors = (tuple(pools), aux, states)
        self._lock = RoundLock()  # an RLock; a periodic round's wait for it is no hold (transfer.round_times)
        self._changes = ChangeFeed(self._lock)
        self._pumped_at = 0.0
        self.rooms: PrefillRooms | DecodeRooms | None = None
        # Built before any allocation: the non-CUDA Mooncake wheel cannot move device memory.
        self.transport: Transport = transport if transport is not None else \
            build_transport(config.engine, pools_device(pools))
        try:
            arenas = ArenaRegistration(self.transport, lambda: self.rooms)  # a fenced decode rank's, as they open
            staging = build_staging(config, pools, pools_device(pools), arenas.register, arenas.unregister)
            # the scheduler's memory registered with the transport (fenced decode: none, only the arenas, as they
            # open); release_memory() takes it back, resume_memory() again
            pool_regions = register_pools(self.transport, pools, aux, states, staging)
            factory = channel_factory if channel_factory is not None else zmq_channel
            self.channel: ControlChannel = factory(ChannelOptions(
                host=config.host, secret=config.secret or None, heartbeat_interval_s=config.heartbeat_interval_s,
                peer_timeout_s=config.peer_timeout_s), self._on_message)
            self.channel.round_times = self._totals.round_times
        except BaseException:
            self.transport.close()
            raise
        #: the staging tensor (uint8; None without staging; a fenced decode rank's: the span of its arenas,
        #: mostly unbacked virtual memory: fault it in with touch_staging(), never by filling it)
        self.staging = staging.tensor if staging is not None else None
        #: whether peers write only into staging arenas (see ManagerConfig, write fence)
        self.fenced = staging is not None and staging.fenced
        log.log(logging.WARNING if "falls back" in self.transport.describe() else logging.INFO,
                "%s: transport %s; control %s", self.where, self.transport.describe(), self.channel.endpoint)
        self.rank = RankInfo(
            node_id=config.node_id, dp_rank=config.dp_rank, dp_size=config.dp_size,
            tp_rank=config.tp_rank, tp_size=config.tp_size, session=self.transport.session,
            control_endpoint=self.channel.endpoint, pools=tuple(describe_pool(p) for p in pools),
            aux=tuple(describe_aux(t) for t in aux), staging=staging.descriptor if staging is not None else None,
            fenced=self.fenced, transport=self.transport.kind, states=tuple(describe_state(s) for s in states))
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
            config=config, where=self.where, rank=self.rank, lock=self._lock, changed=self._changes.changed,
            transport=self.transport, channel=self.channel, staging=staging, storage=self.storage,
            bootstrap_client=self.bootstrap_client, stats=self._totals, aux=aux, pump=self.pump, states=states)
        #: the room table (prefill or decode)
        self.rooms = PrefillRooms(self.context) if config.role is Role.PREFILL else DecodeRooms(self.context)
        self._memory = MemoryRelease(self.context, self.rooms, pool_regions, lambda: self._closed)
        self.watch = PeerWatch(config, self.rank.session, self.channel.endpoint, rooms=self.rooms,
                               channel=self.channel, lock=self._lock, totals=self._totals, where=self.where)
        self.registration = None
        if config.role is Role.PREFILL:
            self.registration = Registration(config, self.rank, self.bootstrap_client, self._learned_sessions,
                                             self.where, self._totals.round_times)
            try:
                self.registration.register()
            except BaseException:
                self.close()
                raise
        if config.metrics_port:
            try:
                from transfer.rank.metrics import serve_metrics
                self.metrics = serve_metrics(self, self._totals.round_times)
            except BaseException:
                self.close()
                raise
        self.watch.start()
        if self.registration is not None:
            self.registration.start()

    def _learned_sessions(self, sessions: frozenset[str]) -> None:
        """The transfer sessions of this node's prefill ranks (no decode peer may declare one)."""
        with self._lock:
            self.rooms.prefill_sessions = self.rooms.prefill_sessions | sessions

    @property
    def where(self) -> str:
        """This rank, for error messages."""
        c = self.config
        return f"{c.role.value} {c.node_id} dp {c.dp_rank} tp {c.tp_rank}/{c.tp_size}"

    def prefill_topology(self, bootstrap_addr: str, node_id: str, *,
                         timeout_s: float | None = None) -> PrefillTopology | None:
        """The DP and TP sizes of prefill node ``node_id`` at the bootstrap
        server ``bootstrap_addr`` (None until its DP group 0 registered): one
        lookup, blocking at most ``timeout_s`` (default
        ``config.rpc_timeout_s``); see
        :func:`~transfer.prefill_topology.lookup_topology`."""
        timeout = self.config.rpc_timeout_s if timeout_s is None else timeout_s
        return lookup_topology(bootstrap_addr, node_id, timeout_s=timeout, secret=self.config.secret or None)

    def hold_room(self, bootstrap_addr: str, room: int, *, prefill_node: str = "prefill",
                  prefill_dp_rank: int | None = None, hold_s: float) -> bool:
        """Decode: the request of ``room`` waits in this scheduler's queue
        (no pages yet, no receiver): ask the room's prefill ranks to keep it
        open ``hold_s`` more seconds (``RoomHold``); renew it until the
        receiver is created or the request is dropped (then abort, as
        ``KVReceiver.abort`` does). Never blocks: False while the prefill
        node is being looked up (call again, e.g. at the next renewal)."""
        if self.config.role is not Role.DECODE:
            raise StateError(f"{self.where}: hold_room is for decode ranks (prefill rooms are held by decode)")
        self.check_open()
        return self.rooms.hold(bootstrap_addr, prefill_node, prefill_dp_rank, room, hold_s)

    def bootstrap_client(self, addr: str) -> BootstrapClient:
        return BootstrapClient(addr, timeout_s=self.config.rpc_timeout_s, secret=self.config.secret or None)

    def touch_staging(self) -> None:
        """Fault in the staging memory in use (benchmarks: as a warmed-up
        server has it); of a fenced decode rank's span only the live arenas."""
        if self.context.staging is not None:
            self.context.staging.touch()

    def pump(self) -> None:
        """Hand the control messages that arrived to the rooms, and move the
        transfers along, now, on this thread (see
        :class:`~transfer.rooms.context.RoomContext`); never blocks. Every
        room's ``poll()`` calls it (at most once per :data:`PUMP_INTERVAL_S`)."""
        now = time.monotonic()
        if now - self._pumped_at < PUMP_INTERVAL_S or self._closed:
            return
        self._pumped_at = now
        self.channel.drain()
        self.transport.pump()

    def _on_message(self, msg, origin: str = "") -> None:
        if isinstance(msg, PeerPing):
            self.watch.on_ping(msg)
        elif isinstance(msg, PeerPong):
            self.watch.on_pong(msg)
        else:
            self.rooms.on_message(msg, origin)

    @property
    def progress(self) -> int:
        """A mark that grows by one whenever any room of this manager changes state."""
        return self._changes.progress

    def changed_rooms(self, since: int) -> tuple[int, list | None]:
        """``(progress, changes)``: the rooms that changed state after the
        mark ``since`` (a ``progress`` value), as ``(room, state)`` pairs
        oldest first; ``changes`` is None when the caller fell too far
        behind: poll every room then (see
        :meth:`~transfer.change_feed.ChangeFeed.since`). Never blocks beyond
        the manager's lock. Each scheduler loop keeps its own mark."""
        return self._changes.since(since)

    def wait_for_progress(self, seen: int, timeout_s: float) -> int:
        """Block until ``progress`` exceeds ``seen`` or ``timeout_s`` passed;
        returns ``progress``. For scheduler loops that would otherwise
        sleep-poll: ``mark, changed = changed_rooms(mark)``, handle those
        rooms, then ``wait_for_progress(mark, ...)``."""
        return self._changes.wait(seen, timeout_s)

    def check_open(self) -> None:
        """ClosedError once closed; MemoryReleasedError between
        :meth:`release_memory` and :meth:`resume_memory` (no room may start)."""
        if self._closed:
            raise ClosedError(f"{self.where}: manager is closed")
        self._memory.check()

    @property
    def memory_released(self) -> bool:
        """Whether :meth:`release_memory` ran and :meth:`resume_memory` not since."""
        return self._memory.released

    def release_memory(self, timeout_s: float | None = None) -> None:
        """The scheduler is about to free the KV pools' memory (SGLang's
        ``release_memory_occupation``, between weight updates in RL loops):
        every live room fails (its peers are told), this waits until no write
        reads or may still land in the pools, at most ``timeout_s`` (default
        ``transfer_timeout_s``; KVTimeoutError past it: the memory must not be
        freed then), and takes them back from the transport; no room starts
        until :meth:`resume_memory`. See
        :meth:`~transfer.rank_memory.MemoryRelease.release`."""
        self._memory.release(timeout_s)

    def resume_memory(self) -> None:
        """The scheduler has the KV pools' memory back, at the same addresses
        (SGLang's ``resume_memory_occupation``): register the pools again and
        take rooms again. Idempotent."""
        self._memory.resume()

    def stats(self) -> ManagerStats:
        """This rank's totals since it started (a frozen copy; any time, from
        any thread): rooms by final state and failure reason, bytes and
        descriptors by pool and path, live rooms, peers, control messages,
        staging and storage (see :class:`~transfer.stats.ManagerStats`)."""
        ch, staging = self.channel, self.context.staging
        storage = self.storage.stats_fields() if self.storage is not None else {}
        with self._lock:
            handshakes = self.transport.handshake_counts() if self.config.role is Role.PREFILL else \
                self.rooms.links.handshake_counts()
            return self._totals.snapshot(
                live_rooms=self.rooms.num_live, peers_live=self.watch.num_watched,
                control_received=ch.num_received, control_malformed=ch.num_malformed,
                control_unauthenticated=ch.num_unauthenticated,
                staging_capacity_bytes=staging.area.nbytes if staging is not None else 0,
                staging_bytes_in_use=staging.area.nbytes - staging.area.free_bytes if staging is not None else 0,
                **storage, **handshakes)

    def close(self) -> None:
        """Stop the threads, unregister (prefill), fail live rooms and tell
        their peers, then close the transport (its outstanding writes fail,
        and their rooms' peers are told) and last the channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        watch, registration, rooms = getattr(self, "watch", None), getattr(self, "registration", None), self.rooms
        if watch is not None:
            watch.close()
        if registration is not None:  # leave at once, not at the rank TTL
            registration.close()
        if rooms is not None:
            rooms.close(ClosedError(f"{self.where}: manager closed"))
        self.transport.close()  # failed writes' callbacks send their rooms' notices on the open channel
        if isinstance(rooms, PrefillRooms):
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

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

