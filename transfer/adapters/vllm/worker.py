"""The worker halves of kvferry's vLLM connector: one KVManager per vLLM
worker rank, a :class:`~transfer.adapters.vllm.prefill_worker.PrefillWorker`
or a :class:`~transfer.adapters.vllm.decode_worker.DecodeWorker`, both on
the :class:`KvferryWorker` below.

Imported only in vLLM's worker processes (it pulls in torch, zmq and the
Mooncake engine). vLLM calls, on its model-runner thread:
``register_kv_caches`` once, then every engine step ``take`` (the step's
metadata: its sends, receives, aborts), ``finished`` (what completed since
the last call), the decode worker's ``load_errors`` or ``failed_receives``
(the receives among them that failed: by block with one KV-cache group, by
request id with several) and ``take_stats`` (the rooms that ended since the
last call).

A driver thread (``kvferry-vllm``) waits for the manager's progress and
polls only the rooms that changed (``KVManager.changed_rooms``): the work
per wake-up is proportional to the rooms that changed, not to the rooms
open. It pushes a prefill room's pages as soon as its decode request
arrived, so no push waits for the next engine step. Time bounds need no
polling here: the manager's liveness thread polls every live room twice a
second, so a room that times out (or whose peer went silent) changes state
and reaches the driver like any other change. The role's own deadlines
(prefill's leases, decode's holds) are the driver's (``_due``). ``take``
polls the rooms it opened once (a decode request may have come first; a
change before the room was listed would be missed). With vLLM's in-process
executor the scheduler half calls ``take`` too, from the scheduler's
thread, as soon as a room is known
(:func:`~transfer.adapters.vllm.scheduler.local_worker`): ``take`` and the
pollers take the worker's lock, so any thread may call it. Nothing blocks
vLLM: ``take`` submits, ``finished`` and ``take_stats`` only take a lock.

Every TP rank has its own worker and KVManager, registered with its TP rank
and size and holding its slice of the KV heads
(:class:`~transfer.adapters.vllm.caches.CacheLayout` gives the model's head
count and vLLM's layout); prefill and decode TP sizes may differ wherever
one divides the other, and kvferry plans the head slices.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

from bootstrap.messages import PoolRole
from transfer.adapters.vllm import stats as vllm_stats
from transfer.adapters.vllm.caches import CacheLayout, group_state_pool, kv_pool
from transfer.adapters.vllm.groups import GroupPlan, layer_order, split_draft
from transfer.adapters.vllm.params import ConnectorConfig
from transfer.config import EngineConfig, ManagerConfig, Role
from transfer.errors import KVFerryError
from transfer.state import KVPoll
from transfer.stats import failure_reason

log = logging.getLogger("kvferry.vllm")

WAKE_S = 0.05  # the driver's longest sleep (its stop flag and the role's deadlines)
#: The engine steps with nothing to compute this long before such a step waits for a room to end
#: (:meth:`KvferryWorker.settle`): a room that ends within it never slows the next request.
IDLE_GRACE_S = 0.05


@dataclass
class Room:
    """A room the worker drives, by vLLM request id."""

    req_id: str
    handle: object  # KVSender or KVReceiver
    pages: tuple[int, ...]  # prefill: the blocks it sends; decode: those it writes (its load errors)
    aborted: bool = False  # by vLLM: its blocks are no one's load errors

    @property
    def reason(self) -> str | None:
        """Why it ended, where its state does not say (the stats' reason)."""
        return None


class KvferryWorker:
    """One vLLM worker rank's rooms; a role's worker adds what it opens
    (``take``), what it reports (``finished``), its deadlines (``_due``)
    and what a room's poll does (``_advance``) and its end (``_ended``)."""

    role: Role
    discovery_type: str  # vllm-router's worker type ("P" or "D")
    abort_why: str  # a room vLLM aborted: the peer is told this

    def __init__(self, config: ConnectorConfig, *, tp_rank: int, tp_size: int,
                 layout: CacheLayout | None = None, groups: GroupPlan | None = None) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"kvferry vLLM worker: tp_rank {tp_rank} not in [0, {tp_size})")
        self.config, self.tp_rank, self.tp_size = config, tp_rank, tp_size
        self.layout = layout or CacheLayout()
        self.groups = groups  # vLLM's KV-cache groups (None: every layer in one)
        self.mgr = None
        self.discovery = None  # TP rank 0: registration with vllm-router (kvferry_router_discovery)
        self._lock = threading.Lock()
        self._rooms: dict[str, Room] = {}
        self._by_handle: dict[int, Room] = {}  # id(handle) of every listed room (it keeps the handle alive)
        self._layer_index: dict[str, int] = {}  # vLLM layer name -> room layer (target's, then the draft's)
        self._stats = vllm_stats.empty()  # rooms ended since the last take_stats()
        self.num_polled = 0  # room polls by this worker (tests: proportional to changes)
        self._done: set[str] = set()  # finished (either way), not yet reported
        self._room_ended = threading.Condition(self._lock)  # notified when a room joins _done
        self._idle_since: float | None = None  # the first of the steps in a row that computed nothing
        self.num_failed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- vLLM's calls ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        """Describe vLLM's per-layer caches as one fused K/V pool (this rank's
        heads of ``layout.total_kv_heads``), each other KV-cache group (HMA)
        as a state pool, and build the manager."""
        from transfer.manager import KVManager  # lazily: Mooncake and zmq load here only

        plan, lay = self.groups, self.layout
        names, draft_names = split_draft(sorted(kv_caches if plan is None else plan.main.layers, key=layer_order),
                                         lay.target_layers)
        layers = [kv_caches[name] for name in names]
        self.index_layers(names, draft_names)
        states = [] if plan is None else \
            [group_state_pool(g, [kv_caches[n] for n in g.layers], lay.mla) for g in plan.states]
        pools = [kv_pool(layers, PoolRole.TARGET, lay.total_kv_heads, lay)]
        if draft_names:  # a speculative draft's own KV: kvferry's draft pool, checked on its own
            pools.append(kv_pool([kv_caches[n] for n in draft_names], PoolRole.DRAFT,
                                 lay.draft_kv_heads or lay.total_kv_heads, lay))
        c = self.config
        self._open_servers()
        mconfig = ManagerConfig(role=self.role, bootstrap_addr=c.kvferry_addr, node_id=c.node_id,
                                host=c.host, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                engine=replace(EngineConfig(), protocol=c.protocol, hostname=c.host),
                                **self._manager_fields())
        try:
            self.attach(KVManager(mconfig, pools, states=states))
        except BaseException:
            self._close_servers()
            raise
        if c.router_discovery and self.tp_rank == 0:  # once this rank can take rooms
            from transfer.control.router_discovery import DiscoveryHeartbeat
            self.discovery = DiscoveryHeartbeat(c.router_discovery, {
                "type": self.discovery_type, "http_address": c.http_address,
                "zmq_address": c.public_kvferry_addr, "dp_size": 1, "tp_size": self.tp_size})
        log.info("kvferry %s worker (TP rank %d of %d): %d layers (%d of a draft), %d blocks of %d bytes per layer, "
                 "%s, %d state pool(s), bootstrap %s", self.role.value, self.tp_rank, self.tp_size, len(layers),
                 len(draft_names), layers[0].shape[0],
                 layers[0][0].numel() * layers[0].element_size(), lay.vllm_layout or lay.kv_layout, len(states),
                 c.kvferry_addr)

    def _manager_fields(self) -> dict:
        """The role's ManagerConfig fields from the extra config."""
        return self.config.manager_fields(prefill=False)

    def _open_servers(self) -> None:
        """What this rank serves before its manager registers (none here)."""

    def _close_servers(self) -> None:
        if self.discovery is not None:
            self.discovery.close()
        self.discovery = None

    def index_layers(self, names: list[str], draft_names: list[str] = ()) -> None:
        """The room's layers by vLLM layer name (the target's in forward
        order, then a draft's)."""
        self._layer_index = {name: i for i, name in enumerate([*names, *draft_names])}

    def attach(self, mgr) -> None:
        """Work through ``mgr`` (register_kv_caches builds it; a test may
        give its own) and start the driver thread."""
        self.mgr = mgr
        self._thread = threading.Thread(target=self._drive, args=(mgr.progress,), name="kvferry-vllm",
                                        daemon=True)
        self._thread.start()

    def take(self, meta) -> None:
        """Act on a step's metadata (the scheduler half's, of this role)."""
        raise NotImplementedError

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(sends done, receives done) since the last call."""
        raise NotImplementedError

    def settle(self, idle: bool) -> None:
        """Before ``finished``, in each step: whether the step computes
        nothing (``idle``). vLLM steps without pause while a room is open
        (prefill: a finished request's blocks kept until its decode asked;
        decode: a request waiting for its KV), each step a round trip to
        this worker and a stats message to vLLM's API server (docs/vllm.md,
        "Idle steps"). Once the engine has stepped idle for
        :data:`IDLE_GRACE_S`, an idle step waits up to
        ``config.idle_wait_s`` while rooms are open and none ended, woken
        at once when one ends: no room's report waits for it. A step that
        computes is never held."""
        wait_s = self.config.idle_wait_s
        if not idle or wait_s <= 0:
            self._idle_since = None
            return
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < IDLE_GRACE_S:
            return
        with self._lock:
            if self._rooms and not self._done:
                self._room_ended.wait(wait_s)

    def load_errors(self) -> set[int]:
        """The blocks of receives that failed since the last call (a role that receives says)."""
        return set()

    def failed_receives(self) -> set[str]:
        """The request ids of receives that failed (a role that receives says)."""
        return set()

    def take_stats(self) -> dict | None:
        """The rooms that ended since the last call (a
        :mod:`~transfer.adapters.vllm.stats` payload), or None: none did."""
        with self._lock:
            if vllm_stats.is_empty(self._stats):
                return None
            data, self._stats = self._stats, vllm_stats.empty()
            return data

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

    # --- rooms ---------------------------------------------------------------------

    def _abort(self, req_ids) -> None:
        """End the rooms of requests vLLM finished while they were live."""
        for req_id in req_ids:
            with self._lock:
                room = self._rooms.get(req_id)
                if room is not None:
                    room.aborted = True
                    self._forget(room)
            if room is not None:
                room.handle.abort(self.abort_why)

    def _forget(self, room: Room) -> None:
        """A room no longer takes the role's own work (the lock held)."""

    def _not_opened(self, req_id: str, exc: KVFerryError) -> None:
        """A room that could not open: reported done, its failure counted (the lock held)."""
        self._done.add(req_id)
        self._room_ended.notify_all()
        vllm_stats.record_failure(self._stats, failure_reason(exc).value)

    def _list(self, room: Room) -> Room:
        with self._lock:
            self._rooms[room.req_id] = room
            self._by_handle[id(room.handle)] = room
        return room

    # --- the driver ----------------------------------------------------------------

    def _drive(self, mark: int) -> None:
        """Wait for progress; poll the rooms that changed after ``mark`` (all
        of them when the change log says the driver fell behind); the role's
        deadlines between."""
        while not self._stop.is_set():
            try:
                self.mgr.wait_for_progress(mark, self._due())
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
                self._stop.wait(WAKE_S)

    def _due(self) -> float:
        """Act on the role's deadlines that passed; the seconds until the next."""
        return WAKE_S

    def _advance(self, room: Room, state: KVPoll) -> KVPoll:
        """What a poll in ``state`` does for the role (prefill: push); the state after."""
        return state

    def _ended(self, room: Room, state: KVPoll) -> None:
        """The role's bookkeeping of a room that ended (the lock held)."""

    def _poll(self, rooms: list[Room]) -> None:
        """Poll ``rooms``: advance them, report the ended ones."""
        self.num_polled += len(rooms)
        for room in rooms:
            state = self._advance(room, room.handle.poll())
            if state not in (KVPoll.Success, KVPoll.Failed):
                continue
            stats = room.handle.stats()
            with self._lock:
                if self._rooms.pop(room.req_id, None) is None:
                    continue  # the other poller reported it
                del self._by_handle[id(room.handle)]
                self._done.add(room.req_id)
                self._room_ended.notify_all()
                vllm_stats.record_room(self._stats, stats, reason=room.reason)
                self.num_failed += state is KVPoll.Failed
                self._ended(room, state)
            if state is KVPoll.Failed:
                try:
                    room.handle.failure_exception()
                except KVFerryError as exc:
                    log.warning("kvferry: request %s failed: %s", room.req_id, exc)
