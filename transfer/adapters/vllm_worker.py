"""The worker half of kvferry's vLLM connector: one KVManager per vLLM worker.

Imported only in vLLM's worker processes (it pulls in torch, zmq and the
Mooncake engine). vLLM calls, on its model-runner thread:
``register_kv_caches`` once, then every engine step ``start`` (the step's
sends and receives) and ``finished`` (what completed since the last call).
A driver thread (``kvferry-vllm``) polls the rooms as they change
(``KVManager.wait_for_progress``) and pushes a prefill room's pages as soon
as its decode request arrived, so no push waits for the next engine step.
``start`` also polls its new prefill rooms once, so a room whose decode
request came first is pushed at once. Nothing blocks vLLM: ``start`` submits
and ``finished`` only takes a lock.

Every TP rank has its own worker and KVManager, registered with its TP rank
and size and holding its slice of the KV heads (:class:`CacheLayout` gives
the model's head count and vLLM's layout); prefill and decode TP sizes may
differ wherever one divides the other, and kvferry plans the head slices.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, replace

from transfer.adapters.vllm_params import ConnectorConfig, RecvSpec, SendSpec
from transfer.config import EngineConfig, ManagerConfig, Role
from transfer.errors import KVFerryError
from transfer.pools import FusedKVPool
from transfer.state import KVPoll

log = logging.getLogger("kvferry.vllm")

_POLL_S = 0.05  # the driver's longest sleep between polls (time bounds are checked in poll())


def _layer_order(name: str) -> tuple:
    """``model.layers.10.self_attn.attn`` after ``model.layers.9...``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


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


@dataclass
class _Room:
    req_id: str
    handle: object  # KVSender or KVReceiver
    pages: tuple[int, ...]
    pushed: bool = False
    aborted: bool = False  # by vLLM: its blocks are no one's load errors


class KvferryWorker:
    """Sends (prefill) or receives (decode) rooms for one vLLM worker rank."""

    def __init__(self, config: ConnectorConfig, *, role: Role, tp_rank: int, tp_size: int,
                 layout: CacheLayout | None = None) -> None:
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"kvferry vLLM worker: tp_rank {tp_rank} not in [0, {tp_size})")
        self.config, self.role, self.tp_rank, self.tp_size = config, role, tp_rank, tp_size
        self.layout = layout or CacheLayout()
        self.mgr = None
        self.server = None
        self._lock = threading.Lock()
        self._rooms: dict[str, _Room] = {}
        self._done: set[str] = set()  # finished (either way), not yet reported
        self._finished_seen: set[str] = set()  # request ids vLLM called finished (sends may be reported)
        self._load_errors: set[int] = set()
        self.num_failed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- vLLM's calls ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        """Describe vLLM's per-layer caches as one fused K/V pool (this rank's
        heads of ``layout.total_kv_heads``) and build the manager."""
        from transfer.manager import KVManager  # lazily: Mooncake and zmq load here only

        layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer_order)]
        lay = self.layout
        pool = FusedKVPool(kv=layers, total_kv_heads=lay.total_kv_heads, kv_layout=lay.kv_layout,
                           vllm_layout=lay.vllm_layout)
        c = self.config
        if c.serve_bootstrap and self.role is Role.PREFILL and self.tp_rank == 0:
            from bootstrap.server import BootstrapServer
            host, _, port = c.bootstrap_addr.rpartition(":")
            self.server = BootstrapServer(host, int(port)).start()
        manager_kw = {"staging_bytes": 0, **c.manager}
        mconfig = ManagerConfig(role=self.role, bootstrap_addr=c.bootstrap_addr, node_id=c.node_id,
                                host=c.host, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                engine=replace(EngineConfig(), protocol=c.protocol, hostname=c.host), **manager_kw)
        try:
            self.mgr = KVManager(mconfig, [pool])
        except BaseException:
            if self.server is not None:
                self.server.close()
            raise
        self._thread = threading.Thread(target=self._drive, name="kvferry-vllm", daemon=True)
        self._thread.start()
        log.info("kvferry %s worker (TP rank %d of %d): %d layers, %d blocks of %d bytes per layer, %s, "
                 "bootstrap %s", self.role.value, self.tp_rank, self.tp_size, len(layers), layers[0].shape[0],
                 layers[0][0].numel() * layers[0].element_size(), lay.vllm_layout or lay.kv_layout,
                 c.bootstrap_addr)

    def start(self, sends: list[SendSpec], recvs: list[RecvSpec], aborts: list[str] = ()) -> None:
        """Open this step's rooms, and abort the decode rooms of ``aborts``
        (requests vLLM finished while their KV was coming). A room that cannot
        open is reported done (and, on decode, its blocks as load errors) at
        the next ``finished``."""
        for req_id in aborts:
            with self._lock:
                room = self._rooms.get(req_id)
                if room is not None:
                    room.aborted = True
            if room is not None:
                room.handle.abort("the request finished on decode before its KV arrived")
        from transfer.receiver import KVReceiver
        from transfer.sender import KVSender

        for s in sends:
            try:
                sender = KVSender(self.mgr, None, s.room)
                sender.init(len(s.pages), token_ids=list(s.token_ids) or None)
            except KVFerryError as exc:
                log.warning("kvferry: request %s (room %d) not sent: %s", s.req_id, s.room, exc)
                with self._lock:
                    self._done.add(s.req_id)
                continue
            with self._lock:
                self._rooms[s.req_id] = _Room(s.req_id, sender, s.pages)
        for r in recvs:
            try:
                receiver = KVReceiver(self.mgr, r.bootstrap_addr, r.room, prefill_node=r.node_id)
                receiver.init(r.pages, token_ids=list(r.token_ids) or None)
            except KVFerryError as exc:
                log.warning("kvferry: request %s (room %d) not received: %s", r.req_id, r.room, exc)
                with self._lock:
                    self._done.add(r.req_id)
                    self._load_errors.update(r.pages)
                continue
            with self._lock:
                self._rooms[r.req_id] = _Room(r.req_id, receiver, r.pages)
        if sends:  # a decode request may have come first (concurrent protocol): push now
            try:
                self._poll_all()
            except Exception:  # never into vLLM's step; the driver polls again
                log.exception("kvferry: poll after opening rooms failed")

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
            return set(), done

    def load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
            return errors

    def num_pending(self) -> int:
        with self._lock:
            return len(self._rooms)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        if self.mgr is not None:
            self.mgr.close()
        if self.server is not None:
            self.server.close()

    # --- the driver ----------------------------------------------------------------

    def _drive(self) -> None:
        seen = -1
        while not self._stop.is_set():
            try:
                seen = self.mgr.wait_for_progress(seen, _POLL_S)
                self._poll_all()
            except Exception:  # the driver must outlive any one round
                log.exception("kvferry: poll round failed")
                self._stop.wait(_POLL_S)

    def _poll_all(self) -> None:
        with self._lock:
            rooms = list(self._rooms.values())
        for room in rooms:
            state = room.handle.poll()
            if self.role is Role.PREFILL and state is KVPoll.WaitingForInput:
                with self._lock:  # two pollers (the driver, and start()): one push
                    push, room.pushed = not room.pushed, True
                if push:
                    room.handle.send(list(room.pages), last=True)
                    state = room.handle.poll()
            if state not in (KVPoll.Success, KVPoll.Failed):
                continue
            with self._lock:
                if self._rooms.pop(room.req_id, None) is None:
                    continue  # the other poller reported it
                self._done.add(room.req_id)
                if state is KVPoll.Failed:
                    self.num_failed += 1
                    if self.role is Role.DECODE and not room.aborted:
                        self._load_errors.update(room.pages)
            if state is KVPoll.Failed:
                try:
                    room.handle.failure_exception()
                except KVFerryError as exc:
                    log.warning("kvferry: request %s failed: %s", room.req_id, exc)
