"""The Mooncake transport: with :mod:`~transfer.transport.mooncake.peer_open`
(which opens its peers), the only code of ``transfer`` that talks to the
Mooncake transfer engine. It keeps the contract of :mod:`transfer.transport.base`.

:class:`MooncakeTransport` owns one ``TransferEngine`` and one worker thread
that moves plans. The engine learns its peers' segments through kvferry's
metadata relay (``EngineConfig.mooncake_metadata="relay"``, the default:
:mod:`transfer.transport.mooncake.relay`) or by Mooncake's P2P handshake
(``"p2p"``). Either way the way to a peer is opened before any plan goes
there (:mod:`transfer.transport.mooncake.peer_open`, on the worker's opener thread: the
segment lookup, then a probe write of a few bytes into the region the peer's
handshake named), so no room's first write runs a handshake. A plan's entries are
submitted one descriptor at a time with ``transfer_submit_write`` and polled
with the non-blocking ``transfer_check_status``: the engine's blocking calls
busy-spin and starve the I/O threads on small machines. The worker keeps at
most ``max_inflight_per_peer`` descriptors outstanding per peer, so the
engine's own per-peer queue never overflows (overflowing can wedge the path to
that peer for good), and at most ``inflight_bytes_per_peer`` bytes: the
engine serves what it holds first come, so what waits beyond that stays here,
where the plans of each peer go lowest ``priority`` (the oldest room) first.

A job's callback runs exactly once, on the worker thread, after every
descriptor it submitted has finished or failed, so the source memory may be
reused when it runs. It must be quick and must not call back into the
transport's blocking methods.

Importing this module does not import Mooncake: the engine is imported when
a transport is built.

Two things the engine does not say, which this module does:

- The protocol in use (:meth:`MooncakeTransport.describe`, logged once per
  manager). Asked for ``rdma`` on a host without an RDMA device, the engine
  initializes without error and moves bytes over TCP; we look at
  ``/sys/class/infiniband`` and say so.
- Exit time. The engine's destructor takes about 0.9 s and holds the GIL
  the whole time (measured here, CPU build 0.3.13), also at interpreter exit
  and also on another thread. ``close()`` therefore unregisters the memory,
  stops using the engine, and keeps the engine object alive for good: it is
  never destroyed, and the process exits in milliseconds. The cost: a closed
  transport's engine keeps its listening sockets and idle threads until the
  process ends (peers' writes to it fail, its memory being unregistered).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

from transfer.config import EngineConfig
from transfer.errors import TransferError
from transfer.plan import TransferPlan, split_entries
from transfer.transport.base import DoneCallback
from transfer.transport.mooncake.peer_meta import check_peer_meta, decode_peer_meta
from transfer.transport.mooncake.peer_open import MooncakePeers
from transfer.transport.peers import OpenCallback, PeerLink
from transfer.transport.mooncake.process import (apply_mooncake_env, keep_forever, quiet_engine_start, rdma_devices,
                                                 stderr_discarded)
from transfer.transport.worker import PollingWorker, close_at_exit, closed_error, gate_state, run_callback

log = logging.getLogger("kvferry.transport")

# The engine has no completion queue: the only way to learn that a descriptor
# finished is one transfer_check_status(id) call per id. It finishes each
# peer's descriptors about in the order they were submitted (its lanes take
# them first in, first out), so a poll round checks each peer's oldest ids
# and stops at the first few still pending: a round costs (completions + this
# many x peers) calls, however many descriptors are in flight. A descriptor
# that finishes early behind a slow one is seen when the slow one finishes.
_PENDING_WINDOW = 4


@dataclass
class _Job:
    peer: str
    src: list[int]
    dst: list[int]
    lengths: list[int]
    callback: DoneCallback
    next_index: int = 0
    num_inflight: int = 0
    error: TransferError | None = None
    done: bool = field(default=False)
    cancelled: bool = False
    ready: object = None  # a transfer.ready.ReadyGate: submit nothing before it is done
    created: float = field(default_factory=time.monotonic)
    priority: float = 0.0  # lower goes first among the peer's queued jobs
    num_landed: int = 0  # descriptors the engine reported done

    def status(self) -> str:
        """Where the job stands, in words (racy reads: diagnostics only)."""
        n = len(self.src)
        if self.done:
            return f"write to {self.peer} ended"
        what = (f"write to {self.peer} of {n} descriptor(s), {sum(self.lengths)} bytes, queued "
                f"{time.monotonic() - self.created:.1f} s ago: ")
        if self.next_index == 0 and self.ready is not None:
            return what + "waiting for its ready event"
        return what + (f"{self.next_index} submitted, {self.num_landed} done, {self.num_inflight} still in the "
                       "engine (Mooncake reports them pending)")

    def waiting(self) -> bool:
        """Whether the job must not start yet (its producer's event is not
        complete); past the gate's deadline the job fails instead."""
        if self.ready is None or self.next_index or self.cancelled:
            return False
        waiting, error = gate_state(self.ready, self.peer)
        if error is not None:
            self.error = self.error or error
            self.next_index = len(self.src)
        elif not waiting:
            self.ready = None
        return waiting

    def cancel(self) -> None:
        """Submit no more of this job's descriptors (those already submitted
        run to their end); its callback then gets a TransferError."""
        self.cancelled = True

    @property
    def finished(self) -> bool:
        return self.next_index >= len(self.src) and self.num_inflight == 0


class MooncakeTransport:
    """Moves :class:`TransferPlan` entries from local memory into a peer's
    registered memory. Thread-safe: ``submit`` may be called from any thread."""

    kind = "mooncake"

    @property
    def peer_metadata(self) -> MooncakeTransport:
        """This transport is its own metadata exchange (:meth:`metadata`)."""
        return self

    def __init__(self, config: EngineConfig) -> None:
        apply_mooncake_env(config)
        if config.mooncake_metadata == "relay":  # its process starts while the engine is imported and built
            from transfer.transport.mooncake.relay import start_relay_store
            start_relay_store()
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError(f"the Mooncake transfer engine is not installed: {exc}") from exc
        self.config = config
        self._engine = TransferEngine()
        #: its name, metadata mode, probe region and the peers it opened
        self.peers = MooncakePeers(config)
        with stderr_discarded(quiet_engine_start(config)):
            self.peers.initialize(self._engine)
        self.session = self.peers.session
        #: the port of the engine's handshake listener (P2P: the session's; relay: RDMA's connection requests)
        self.handshake_port = self._engine.get_rpc_port()
        self._registered: list[int] = []
        self._meta = self.peers.own_meta()
        self.num_descriptors = 0
        self.num_bytes = 0
        #: engine status checks so far (what completion tracking costs)
        self.num_status_checks = 0
        # The worker's state (under its step lock): jobs by peer not fully submitted (by priority),
        # descriptors and bytes outstanding per peer, and per peer, oldest first, (engine id, job, bytes) of submitted ones.
        self._by_peer: dict[str, collections.deque[_Job]] = collections.defaultdict(collections.deque)
        self._inflight: dict[str, int] = collections.defaultdict(int)
        self._inflight_peer_bytes: dict[str, int] = collections.defaultdict(int)
        self._outstanding: dict[str, collections.deque[tuple[int, _Job, int]]] = \
            collections.defaultdict(collections.deque)
        self._worker = PollingWorker(self, open_timeout_s=config.handshake_timeout_s)
        close_at_exit(self)

    @property
    def num_rounds(self) -> int:
        """Worker rounds so far (what completion tracking costs)."""
        return self._worker.num_rounds

    def describe(self) -> str:
        """The transport actually in use, in words (for one log line)."""
        how = "metadata relayed by kvferry" if self.peers.mode == "relay" else "P2P handshake"
        what = f"Mooncake {self.config.protocol}, {how} (session {self.session}, handshake port {self.handshake_port})"
        if self.config.protocol == "rdma" and not rdma_devices():
            what += ("; protocol 'rdma' was asked for, but this host has no RDMA device (/sys/class/infiniband "
                     "is empty or missing): Mooncake falls back to TCP")
        return what

    # --- memory ---------------------------------------------------------------

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Register (addr, nbytes) regions that peers may write into."""
        if not regions:
            return
        addrs = [a for a, _ in regions]
        rc = self._engine.batch_register_memory(addrs, [n for _, n in regions])
        if rc != 0:
            raise TransferError(f"registering {len(regions)} KV buffers with Mooncake returned {rc}", code=rc)
        self._registered.extend(addrs)
        self._meta = self.peers.own_meta()

    def unregister(self, regions: list[tuple[int, int]]) -> None:
        """Unregister regions given to :meth:`register` (by address). The TCP
        transport then refuses new writes into them; one it accepted before
        still lands in full (it validates once per write request)."""
        addrs = [a for a, _ in regions if a in self._registered]
        if not addrs:
            return
        rc = self._engine.batch_unregister_memory(addrs)
        if rc != 0:
            raise TransferError(f"unregistering {len(addrs)} buffers from Mooncake returned {rc}", code=rc)
        gone = set(addrs)
        self._registered = [a for a in self._registered if a not in gone]
        self._meta = self.peers.own_meta()

    # --- peers ----------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This rank's part of the handshake (``PeerHello.transport_meta``)."""
        return self._meta

    def open_peer(self, peer: str, blob: bytes, callback: OpenCallback | None = None) -> None:
        """Open the way to ``peer`` from what its handshake carried (see
        :mod:`transfer.transport.base`): checked here (ProtocolError,
        IncompatibleTransportError at once), opened on the opener thread."""
        if blob:
            check_peer_meta(decode_peer_meta(blob), peer, self.peers.mode)
        self._worker.opener.open(peer, blob, callback)

    def open(self, peer: str, blob: bytes, pause) -> None:
        """The opener's engine call (see :mod:`transfer.transport.mooncake.peer_open`)."""
        self.peers.open(peer, blob, pause)

    def describe_open(self, link: PeerLink) -> str:
        """What the engine is doing for an open past its deadline (see the worker's EngineSide)."""
        return self.peers.describe_open(link)

    def handshake_counts(self) -> dict[str, float]:
        """The opener's counters (see :meth:`~transfer.transport.opener.PeerOpener.counters`), and
        ``handshake_stale_writes`` (:attr:`~transfer.transport.mooncake.peer_open.MooncakePeers.num_stale_writes`)."""
        return {**self._worker.opener.counters(), "handshake_stale_writes": self.peers.num_stale_writes}

    # --- transfers --------------------------------------------------------------

    def submit(self, peer: str, plan: TransferPlan, callback: DoneCallback, ready,
               priority: float = 0.0) -> _Job | None:
        """Queue ``plan`` for writing into ``peer`` (a Mooncake session
        ``host:port``); returns at once, with a handle whose ``cancel()``
        stops what was not submitted yet (None for an empty plan, which
        completes at once). ``callback(None)`` on success or
        ``callback(TransferError)``. ``ready`` (a
        :class:`~transfer.ready.ReadyGate`): the worker submits none of the
        plan's descriptors before it is done (polled, never blocking; later
        jobs to the same peer go ahead meanwhile). ``priority``: lower goes
        first among the peer's jobs waiting for the link (see the module
        docstring)."""
        self._worker.check_open()
        if plan.num_descriptors == 0:
            callback(None)
            return None
        plan = split_entries(plan, self.config.max_descriptor_bytes)
        job = _Job(peer, plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.lengths.tolist(), callback,
                   ready=ready, priority=priority)
        self._worker.put(job)
        return job

    def pump(self) -> None:
        """Move this transport's work along on the caller's thread (see
        :mod:`transfer.transport.base`)."""
        self._worker.pump()

    def describe_job(self, job: _Job) -> str:
        """Where a plan :meth:`submit` took stands, and the worker's health (for a failure's message)."""
        opening = self._worker.opener.describe_peer(job.peer)
        first = f"; {opening}" if opening else ""
        held = self._inflight_peer_bytes.get(job.peer, 0)
        link = f"; {held} bytes to {job.peer} in the engine (at most {self.config.inflight_bytes_per_peer})"
        return f"{job.status()}{link}; {self._worker.health()}{first}"

    # --- the worker's side (transfer.transport.worker.EngineSide) -------------------

    def admit(self, job: _Job) -> None:
        jobs = self._by_peer[job.peer]
        i = len(jobs)
        while i and jobs[i - 1].priority > job.priority:  # usually none: later rooms come later
            i -= 1
        jobs.insert(i, job)

    def step(self, may_submit: bool) -> tuple[int, bool]:
        if may_submit:
            self._submit_round(self._by_peer, self._inflight, self._outstanding, self.config.max_inflight_per_peer,
                               self.config.inflight_bytes_per_peer)
        self._check_round(self._outstanding, self._inflight)
        return sum(self._inflight_peer_bytes.values()), bool(self._outstanding or self._by_peer)

    def idle(self) -> None:
        """Nothing accumulates here without jobs."""

    def fail_all(self) -> None:
        jobs = {id(j): j for q in self._by_peer.values() for j in q}
        jobs.update({id(j): j for ids in self._outstanding.values() for _, j, _ in ids})
        for job in jobs.values():
            self.fail(job)

    @staticmethod
    def fail(job: _Job, error: TransferError | None = None) -> None:
        if not job.done:
            job.done = True
            run_callback(job.callback, error or closed_error(job.peer))

    def _submit_round(self, by_peer, inflight, outstanding, cap, cap_bytes) -> bool:
        progressed = False
        submit = self._engine.transfer_submit_write
        peer_bytes = self._inflight_peer_bytes
        for peer in list(by_peer):
            jobs = by_peer[peer]
            while jobs and inflight[peer] < cap and peer_bytes[peer] < cap_bytes:
                # The first job not waiting for its ready event (a late event
                # holds back its own job only, not the rooms behind it).
                job = next((j for j in jobs if not j.waiting()), None)
                if job is None:
                    break
                n = len(job.src)
                if job.cancelled and job.next_index < n:
                    job.error = job.error or TransferError(f"transfer to {peer} cancelled", peer=peer)
                    job.next_index = n
                while job.next_index < n and inflight[peer] < cap and peer_bytes[peer] < cap_bytes:
                    i = job.next_index
                    tid = submit(peer, job.src[i], job.dst[i], job.lengths[i])
                    if tid == 0:
                        job.error = job.error or TransferError(
                            f"Mooncake refused a write of {job.lengths[i]} bytes to {peer} "
                            f"(descriptor {i} of {n})", peer=peer)
                        job.next_index = n
                        break
                    outstanding[peer].append((tid, job, job.lengths[i]))
                    peer_bytes[peer] += job.lengths[i]
                    job.next_index += 1
                    job.num_inflight += 1
                    inflight[peer] += 1
                    progressed = True
                if job.next_index >= n:
                    jobs.remove(job)
                    self._maybe_finish(job)
            if not jobs:
                del by_peer[peer]
        return progressed

    def _check_round(self, outstanding, inflight) -> bool:
        progressed = False
        for peer in list(outstanding):
            ids = outstanding[peer]
            progressed |= self._check_peer(ids, inflight)
            if not ids:
                del outstanding[peer]
        return progressed

    def _check_peer(self, ids, inflight) -> bool:
        """Check one peer's oldest ids until ``_PENDING_WINDOW`` are pending."""
        progressed = False
        check = self._engine.transfer_check_status
        pending = []
        while ids and len(pending) < _PENDING_WINDOW:
            tid, job, nbytes = ids.popleft()
            status = check(tid)
            self.num_status_checks += 1
            if status == 0:
                pending.append((tid, job, nbytes))
                continue
            progressed = True
            self._inflight_peer_bytes[job.peer] -= nbytes
            job.num_inflight -= 1
            inflight[job.peer] -= 1
            if status == 1:
                self.num_descriptors += 1
                job.num_landed += 1
            elif job.error is None:
                what = "timed out" if status == -2 else "failed"
                job.error = TransferError(
                    f"write to {job.peer} {what} (Mooncake status {status}) {time.monotonic() - job.created:.1f} s "
                    f"after it was queued, {job.num_landed} of {len(job.src)} descriptor(s) landed "
                    f"({sum(job.lengths)} bytes in all)", peer=job.peer, code=status)
                job.next_index = len(job.src)  # stop submitting the rest of this job
            self._maybe_finish(job)
        ids.extendleft(reversed(pending))  # still the oldest, in order
        return progressed

    def _maybe_finish(self, job: _Job) -> None:
        if job.done or not job.finished:
            return
        job.done = True
        if job.error is None:
            self.num_bytes += sum(job.lengths)
        run_callback(job.callback, job.error)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the worker (outstanding jobs fail) and unregister memory."""
        if not self._worker.close(timeout_s):
            return
        if self._registered:
            self._engine.batch_unregister_memory(self._registered)
            self._registered = []
        keep_forever(self._engine)  # see the module docstring: its destructor costs ~1 s with the GIL held

