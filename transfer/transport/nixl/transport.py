"""The NIXL transport: kvferry's data path on a NIXL agent (UCX by default;
any NIXL network plugin by ``EngineConfig.nixl_backend``, with
``nixl_options`` its parameters, to which a UCX backend gets kvferry's UCX
defaults, :func:`~transfer.transport.nixl.api.backend_params`). It keeps the contract of
:mod:`transfer.transport.base`; docs/transports.md says when to use it.

One agent per transport, no listener thread (it binds every interface and
answers anyone): a decode rank's agent metadata and registered regions
travel in kvferry's handshake (:meth:`NixlTransport.metadata`, loaded by the
prefill side's opener thread, :meth:`NixlTransport.open`, which also makes
UCX's connection to the peer before any plan goes there: the transport is
its own :class:`~transfer.transport.base.PeerMetadata`; see
:mod:`transfer.transport.nixl.peers`). A plan becomes one NIXL transfer
request with the plan's descriptor lists (split only past
``_MAX_DESCS_PER_REQUEST``), posted and polled on the worker thread; NIXL
and UCX handle many small descriptors in one request, so nothing is split
into per-descriptor writes.

``unregister`` deregisters the memory from the agent. UCX does not refuse a
write into memory its target deregistered (measured: it lands, over shared
memory and over TCP alike), and NIXL keeps every section of a peer's
metadata it ever loaded; so the writer refuses it: it checks each plan
against the regions the peer last announced, and a decode rank announces
anew (a fresh ``PeerHello``) whenever its registered memory changes. A
writer that missed the announcement (stopped, partitioned) can still land a
late write: the write fence never reads or grants such memory again
(docs/reliability.md).

A posted request that is still running after ``progress_timeout_s`` plus
its bytes at 1 GB/s is released (NIXL cancels it) and fails.

Importing this module does not import NIXL.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from transfer.config import EngineConfig
from transfer.errors import HandshakeError, TransferError
from transfer.plan import TransferPlan, split_entries
from transfer.transport.base import DoneCallback
from transfer.transport.nixl.api import backend_params, import_api, new_agent
from transfer.transport.nixl.peers import PeerRegions, decode_metadata, encode_metadata
from transfer.transport.peers import OpenCallback, PeerLink
from transfer.transport.worker import PollingWorker, close_at_exit, closed_error, gate_state, run_callback

#: Sent with every write request. NIXL's UCX backend then completes a request only once UCX
#: flushed it to the peer (the bytes are in the peer's memory), not when they left this process:
#: without it, a write to a peer that is slow to progress (stopped, starved) reported done while
#: its bytes still sat in a socket, and decode, told over the control channel, read stale staging.
_NOTIF = b"k"
#: How often a busy loop discards the notifications (an idle one: every idle wake-up).
_DRAIN_NOTIFS_S = 0.5
log = logging.getLogger("kvferry.transport")

_MAX_DESCS_PER_REQUEST = 1 << 16
_agent_ids = itertools.count()


@dataclass
class _Peer:
    agent: str
    regions: PeerRegions


@dataclass
class _Job:
    peer: str
    plan: TransferPlan
    callback: DoneCallback
    ready: object = None
    cancelled: bool = False
    handles: list = field(default_factory=list)
    deadline: float = 0.0
    error: TransferError | None = None
    created: float = field(default_factory=time.monotonic)
    done: bool = False

    def status(self) -> str:
        """Where the job stands, in words (racy reads: diagnostics only)."""
        if self.done:
            return f"write to {self.peer} ended"
        what = (f"write to {self.peer} of {self.plan.num_descriptors} descriptor(s), {self.plan.total_bytes} bytes, "
                f"queued {time.monotonic() - self.created:.1f} s ago: ")
        if not self.handles:
            return what + "not posted yet (its ready event, or the peer's metadata)"
        return what + f"{len(self.handles)} NIXL request(s) still running"

    def cancel(self) -> None:
        """Post nothing of this plan if it was not posted yet (a posted
        request runs to its end); its callback then gets a TransferError."""
        self.cancelled = True


class NixlTransport:
    """Moves :class:`TransferPlan` entries into a peer's registered memory
    through NIXL. Thread-safe: ``submit`` from any thread; the agent runs in
    NIXL's strict thread-safe mode."""

    kind = "nixl"

    @property
    def peer_metadata(self) -> NixlTransport:
        """This transport is its own metadata exchange (:meth:`metadata`)."""
        return self

    def __init__(self, config: EngineConfig, *, memory: str = "DRAM", device_id: int = 0) -> None:
        api = import_api()
        self.config = config
        self.memory, self.device_id = memory, device_id
        self.name = f"kvferry-{config.hostname}-{os.getpid()}-{next(_agent_ids)}"
        #: what peers pass as ``peer``: ``host:agent`` (the host part is what peer_check compares)
        self.session = f"{config.hostname}:{self.name}"
        self.backend = config.nixl_backend
        #: the backend's initialization parameters
        self.params = backend_params(self.backend, config.nixl_options)
        try:
            agent_config = api.nixl_agent_config(
                enable_prog_thread=True, enable_listen_thread=False, backends=[],
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            self._agent = new_agent(api, self.name, agent_config, config.nixl_progress_delay_us)
            if self.backend not in self._agent.get_plugin_list():
                raise TransferError(f"this NIXL build has no {self.backend} plugin "
                                    f"(it has {', '.join(self._agent.get_plugin_list())})")
            self._agent.create_backend(self.backend, self.params)
        except TransferError:
            raise
        except Exception as exc:  # NIXL raises its own exception types
            raise TransferError(f"cannot start a NIXL agent with the {self.backend} backend "
                                f"(options {self.params}): {type(exc).__name__}: {exc}") from exc
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # addr -> nbytes
        self._peers: dict[str, _Peer] = {}
        self.num_bytes = 0
        self.num_descriptors = 0
        #: NIXL transfer requests posted so far
        self.num_requests = 0
        self._inflight_bytes = 0
        self._waiting: list[_Job] = []  # the worker's: not posted yet (a ready gate not done)
        self._posted: list[_Job] = []  # the worker's: requests running
        self._drained_at = time.monotonic()  # notifications last discarded (the worker's)
        self._worker = PollingWorker(self, open_timeout_s=config.handshake_timeout_s)
        close_at_exit(self)

    def describe(self) -> str:
        """The transport in use, in words (for one log line)."""
        options = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"NIXL {self.backend}{f' ({options})' if options else ''} (agent {self.name})"

    # --- memory and peers -------------------------------------------------------

    def _descs(self, regions):
        return self._agent.get_reg_descs([(int(a), int(n), self.device_id, "") for a, n in regions], self.memory)

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Register (addr, nbytes) regions that peers may write into (and
        that plans read from)."""
        if not regions:
            return
        try:
            self._agent.register_memory(self._descs(regions), backends=[self.backend])
        except Exception as exc:
            raise TransferError(f"NIXL could not register {len(regions)} {self.memory} regions: {exc}") from exc
        with self._lock:
            self._registered.update((int(a), int(n)) for a, n in regions)

    def unregister(self, regions: list[tuple[int, int]]) -> None:
        """Deregister regions given to :meth:`register` (by address); peers
        refuse writes into them once they loaded this rank's next
        :meth:`metadata` (see the module docstring)."""
        with self._lock:
            gone = [(a, self._registered.pop(int(a))) for a, _ in regions if int(a) in self._registered]
        if gone:
            try:
                self._agent.deregister_memory(self._descs(gone), backends=[self.backend])
            except Exception as exc:
                raise TransferError(f"NIXL could not deregister {len(gone)} regions: {exc}") from exc

    def metadata(self) -> bytes:
        """What a peer needs to write into this transport's registered
        memory (its agent's metadata and the regions), for :meth:`add_peer`."""
        with self._lock:
            regions = list(self._registered.items())
        return encode_metadata(self._agent.get_agent_metadata(), regions)

    def open_peer(self, peer: str, blob: bytes, callback: OpenCallback | None = None) -> None:
        """Take a peer's :meth:`metadata` (again, when its memory changed)
        and open the way to it; returns at once (ProtocolError for a
        malformed blob, here). The opener thread loads it and connects
        (:meth:`open`; measured 0.13-0.17 s on an idle 2-core host, seconds
        under load), which must stall no caller's thread (the control
        thread's silence would look like a dead peer; a scheduler's would
        freeze its engine)."""
        if blob:
            decode_metadata(blob)
        self._worker.opener.open(peer, blob, callback)

    def open(self, peer: str, blob: bytes, pause) -> None:
        """The opener's engine call: load the peer agent's metadata and make
        UCX's connection to it (the agent's lock held: inside ``pause()``)."""
        if not blob:
            raise HandshakeError(f"no NIXL metadata of peer {peer} (no handshake with it)", peer=peer)
        agent_md, regions = decode_metadata(blob)
        try:
            with pause():
                name = self._agent.add_remote_agent(agent_md)
                name = name.decode() if isinstance(name, bytes) else str(name)
                self._agent.make_connection(name, [self.backend])
        except Exception as exc:
            raise HandshakeError(f"cannot load the NIXL metadata of peer {peer} or connect to it: "
                                 f"{type(exc).__name__}: {exc}", peer=peer) from exc
        with self._lock:
            self._peers[peer] = _Peer(name, regions)

    def describe_open(self, link: PeerLink) -> str:
        """What NIXL is doing for an open past its deadline."""
        return "NIXL is loading its agent's metadata and connecting to it (UCX wire-up)"

    def handshake_counts(self) -> dict[str, float]:
        """The opener's counters (see :meth:`~transfer.transport.opener.PeerOpener.counters`)."""
        return self._worker.opener.counters()

    # --- transfers --------------------------------------------------------------

    def submit(self, peer: str, plan: TransferPlan, callback: DoneCallback, ready,
               priority: float = 0.0) -> _Job | None:
        """Queue ``plan`` for writing into ``peer`` (a session whose
        metadata :meth:`open_peer` took); returns at once. See
        :mod:`transfer.transport.base`. ``priority`` is not used: a plan is
        posted, as one NIXL request, as soon as it is ready, and UCX runs
        the posted requests side by side (holding plans back until the
        peer's earlier ones ended, as Mooncake's transport does, slowed 8
        concurrent 1 GiB rooms over shared memory: last room 1.1-1.3 s
        against 0.9-1.0 s, a plan being one request)."""
        self._worker.check_open()
        if plan.num_descriptors == 0:
            callback(None)
            return None
        job = _Job(peer, plan, callback, ready=ready)
        self._worker.put(job)
        return job

    def pump(self) -> None:
        """Move this transport's work along on the caller's thread (see
        :mod:`transfer.transport.base`)."""
        self._worker.pump()

    def describe_job(self, job: _Job) -> str:
        """Where a plan :meth:`submit` took stands, and the worker's health (for a failure's message)."""
        return f"{job.status()}; {self._worker.health()}"

    # --- the worker's side (transfer.transport.worker.EngineSide) -------------------

    def admit(self, job: _Job) -> None:
        self._waiting.append(job)

    def step(self, may_submit: bool) -> tuple[int, bool]:
        if time.monotonic() - self._drained_at > _DRAIN_NOTIFS_S:
            self._drain_notifs()
        still = []
        for job in self._waiting:
            if not may_submit or (not job.cancelled and gate_state(job.ready, job.peer)[0]):
                still.append(job)  # a late event holds back its own job only
            elif self._post(job):
                self._posted.append(job)
        self._waiting = still
        self._posted = [job for job in self._posted if not self._check(job)]
        return (self._inflight_bytes if self._posted else 0), bool(self._waiting or self._posted)

    def idle(self) -> None:
        self._drain_notifs()

    def _drain_notifs(self) -> None:
        """Discard the notifications peers' writes left in this agent (see
        ``_NOTIF``): NIXL keeps them until asked for them."""
        try:
            self._agent.get_new_notifs()
        except Exception as exc:  # never into the loop: the next drain tries again
            log.debug("NIXL notifications not drained: %s", exc)
        self._drained_at = time.monotonic()

    def fail_all(self) -> None:
        jobs, self._waiting, self._posted = self._waiting + self._posted, [], []
        for job in jobs:
            self.fail(job)

    def _post(self, job: _Job) -> bool:
        """Post the job's requests; True while they run, False when the job
        finished at once (failed, or done: its callback ran)."""
        plan, peer = job.plan, job.peer
        _, gate_error = gate_state(job.ready, peer)
        with self._lock:
            target = self._peers.get(peer)
        error = gate_error
        if job.cancelled:
            error = TransferError(f"transfer to {peer} cancelled", peer=peer)
        elif error is None and target is None:  # its open failed and a later one was not asked for yet
            error = TransferError(f"no NIXL metadata of peer {peer} (no handshake with it)", peer=peer)
        elif error is None and (bad := target.regions.first_outside(plan.dst_addrs, plan.lengths)) >= 0:
            error = TransferError(f"descriptor {bad}: destination [{int(plan.dst_addrs[bad]):#x}, "
                                  f"+{int(plan.lengths[bad])}) is outside the memory {peer} registered", peer=peer)
        if error is not None:
            self._finish(job, error)
            return False
        # Pieces of at most max_descriptor_bytes (4 MiB): UCX over TCP moves 64 descriptors of 16 MiB
        # at about 0.6 of the rate of 256 of 4 MiB (raw NIXL's best entry size, docs/performance.md).
        plan = job.plan = split_entries(plan, self.config.max_descriptor_bytes)
        zeros = np.full(plan.num_descriptors, self.device_id, dtype=np.uint64)
        local = np.stack([plan.src_addrs.astype(np.uint64), plan.lengths.astype(np.uint64), zeros], axis=1)
        remote = np.stack([plan.dst_addrs.astype(np.uint64), plan.lengths.astype(np.uint64), zeros], axis=1)
        agent = self._agent
        job.deadline = time.monotonic() + self.config.progress_timeout_s + plan.total_bytes / 1e9
        for start in range(0, plan.num_descriptors, _MAX_DESCS_PER_REQUEST):
            part = slice(start, start + _MAX_DESCS_PER_REQUEST)
            try:
                handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local[part], self.memory),
                                               agent.get_xfer_descs(remote[part], self.memory), target.agent,
                                               notif_msg=_NOTIF, backends=[self.backend])
                job.handles.append(handle)
                state = agent.transfer(handle)
            except Exception as exc:
                job.error = TransferError(f"NIXL refused a write of {plan.num_descriptors} descriptors to {peer}: "
                                          f"{type(exc).__name__}: {exc}", peer=peer)
                break
            self.num_requests += 1
            if state == "ERR":
                job.error = TransferError(f"NIXL failed to post a write to {peer}", peer=peer)
                break
        self._inflight_bytes += plan.total_bytes
        return not self._check(job)

    def _check(self, job: _Job) -> bool:
        """Poll the job's requests; True when it finished (callback run)."""
        running = []
        for handle in job.handles:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as exc:  # a failed transfer surfaces as a raised NIXL status
                state = "ERR"
                log.debug("NIXL transfer to %s failed: %s", job.peer, exc)
            if state == "PROC":
                running.append(handle)
                continue
            if state != "DONE" and job.error is None:
                job.error = TransferError(f"NIXL write to {job.peer} failed (state {state})", peer=job.peer)
            self._release(handle)
        if running and time.monotonic() > job.deadline:
            for handle in running:
                self._release(handle)
            running = []
            job.error = job.error or TransferError(
                f"NIXL write to {job.peer} did not finish within {self.config.progress_timeout_s} s "
                "(plus 1 s per GB); cancelled", peer=job.peer)
        job.handles = running
        if running:
            return False
        self._inflight_bytes -= job.plan.total_bytes
        return self._finish(job, job.error)

    def _release(self, handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            log.warning("NIXL could not release a transfer request: %s", exc)

    def _finish(self, job: _Job, error: TransferError | None) -> bool:
        """Run the job's callback (once: the job is in no list afterwards); True."""
        if error is None:
            self.num_bytes += job.plan.total_bytes
            self.num_descriptors += job.plan.num_descriptors
        job.done = True
        run_callback(job.callback, error)
        return True

    def fail(self, job: _Job, error: TransferError | None = None) -> None:
        for handle in job.handles:
            self._release(handle)
        job.handles = []
        job.done = True
        run_callback(job.callback, error or closed_error(job.peer))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the worker (outstanding plans fail; their requests are
        released) and deregister memory. Idempotent."""
        if not self._worker.close(timeout_s):
            return
        with self._lock:
            regions = list(self._registered.items())
            self._registered.clear()
        if regions:
            try:
                self._agent.deregister_memory(self._descs(regions), backends=[self.backend])
            except Exception as exc:
                log.warning("NIXL could not deregister %d regions at close: %s", len(regions), exc)
