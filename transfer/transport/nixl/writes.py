"""The NIXL transport's writes in flight: the engine's side of the worker's
loop (:class:`~transfer.transport.worker.EngineSide`: ``admit``, ``step``,
``idle``, ``fail``, ``fail_all``) for
:class:`~transfer.transport.nixl.transport.NixlTransport`. Imports no NIXL:
it is handed the transport's agent.

A job is posted once its ready event completed (a late event holds back its
own job only): checked against the regions its peer last announced (a
descriptor outside them fails the job before anything is posted, see
:mod:`transfer.transport.nixl.peers`), split into pieces of at most
``max_descriptor_bytes`` and posted as one NIXL transfer request (split
only past :data:`_MAX_DESCS_PER_REQUEST` descriptors), then polled each
round. A request still running after ``progress_timeout_s`` plus its bytes
at 1 GB/s is released (NIXL cancels it) and its job fails. A job's callback
runs exactly once, after every request it posted ended and was released.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from collections.abc import Callable

import numpy as np

from transfer.config import EngineConfig
from transfer.errors import TransferError
from transfer.plan import TransferPlan, split_entries
from transfer.transport.base import DoneCallback
from transfer.transport.nixl.peers import PeerRegions
from transfer.transport.worker import closed_error, end_job, gate_state

#: Sent with every write request. NIXL's UCX backend then completes a request only once UCX
#: flushed it to the peer (the bytes are in the peer's memory), not when they left this process:
#: without it, a write to a peer that is slow to progress (stopped, starved) reported done while
#: its bytes still sat in a socket, and decode, told over the control channel, read stale staging.
_NOTIF = b"k"
#: How often a busy loop discards the notifications (an idle one: every idle wake-up).
_DRAIN_NOTIFS_S = 0.5
log = logging.getLogger("kvferry.transport")

_MAX_DESCS_PER_REQUEST = 1 << 16


@dataclass
class NixlPeer:
    """A peer this transport opened: its agent's name and the regions it announced."""

    agent: str
    regions: PeerRegions


@dataclass
class NixlJob:
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


class NixlWrites:
    """The jobs of one transport's ``agent`` (its ``memory`` kind and
    ``device_id``, ``config.nixl_backend``), from ``admit`` to their
    callback; ``peer(name)`` is the :class:`NixlPeer` the transport opened
    (None: none), taken under the transport's lock.

    Threads: every method runs under the worker's step lock, one at a time
    (on the worker thread, or a scheduler's in ``pump()``), but :meth:`fail`
    of a job that never reached :meth:`admit` (on the opener's thread, or
    the closing one). A round blocks on nothing but NIXL's own calls
    (posting and polling a request, taking notifications) and the
    transport's lock for a peer lookup. Nothing raises: NIXL's exceptions
    fail their job (its callback gets a TransferError naming the peer) or,
    for a release or a notification drain, are logged; a callback's
    exception is logged."""

    def __init__(self, agent, config: EngineConfig, memory: str, device_id: int,
                 peer: Callable[[str], NixlPeer | None]) -> None:
        self._agent, self.config, self.memory, self.device_id, self._peer = agent, config, memory, device_id, peer
        self.backend = config.nixl_backend
        self.num_bytes = 0
        self.num_descriptors = 0
        #: NIXL transfer requests posted so far
        self.num_requests = 0
        self._inflight_bytes = 0
        self._waiting: list[NixlJob] = []  # not posted yet (a ready gate not done)
        self._posted: list[NixlJob] = []  # requests running
        self._drained_at = time.monotonic()  # notifications last discarded

    def admit(self, job: NixlJob) -> None:
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

    def _post(self, job: NixlJob) -> bool:
        """Post the job's requests; True while they run, False when the job
        finished at once (failed, or done: its callback ran)."""
        plan, peer = job.plan, job.peer
        _, gate_error = gate_state(job.ready, peer)
        target = self._peer(peer)
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

    def _check(self, job: NixlJob) -> bool:
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

    def _finish(self, job: NixlJob, error: TransferError | None) -> bool:
        """Run the job's callback (once: the job is in no list afterwards); True."""
        if error is None:
            self.num_bytes += job.plan.total_bytes
            self.num_descriptors += job.plan.num_descriptors
        end_job(job, error)
        return True

    def fail(self, job: NixlJob, error: TransferError | None = None) -> None:
        for handle in job.handles:
            self._release(handle)
        job.handles = []
        end_job(job, error or closed_error(job.peer))
