"""The Mooncake transport's writes in flight: the engine's side of the
worker's loop (:class:`~transfer.transport.worker.EngineSide`: ``admit``,
``step``, ``idle``, ``fail``, ``fail_all``) for
:class:`~transfer.transport.mooncake.transport.MooncakeTransport`. Imports
no Mooncake: it is handed the engine, of which it calls
``transfer_submit_write`` and ``transfer_check_status`` only.

A round submits each peer's queued jobs one descriptor at a time, lowest
``priority`` (the oldest room) first, while the peer has fewer than
``max_inflight_per_peer`` descriptors and ``inflight_bytes_per_peer`` bytes
in the engine (overflowing the engine's own per-peer queue can wedge the path
to that peer for good; what waits beyond the bytes stays here, in priority
order, because the engine serves what it holds first come). A job waiting
for its ready event holds back only itself, not the jobs behind it. Then the
round polls the descriptors in flight (see :data:`_PENDING_WINDOW`) and runs
the callbacks of the jobs that ended: exactly once, after every descriptor a
job submitted finished or failed.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from transfer.config import EngineConfig
from transfer.errors import TransferError
from transfer.transport.base import DoneCallback
from transfer.transport.worker import closed_error, end_job, gate_state

log = logging.getLogger("kvferry.transport")

# The engine has no completion queue: the only way to learn that a descriptor
# finished is one transfer_check_status(id) call per id. It finishes each
# peer's descriptors about in the order they were submitted (its lanes take
# them first in, first out), so a poll round checks each peer's oldest ids
# and stops at the first few still pending: a round costs (completions + this
# many x peers) calls, however many descriptors are in flight. A descriptor
# that finishes early behind a slow one is seen when the slow one finishes.
_PENDING_WINDOW = 4


class Submitted(NamedTuple):
    """One descriptor in the engine: its engine id, its job, bytes, index in the job, and when it was submitted."""

    tid: int
    job: MooncakeJob
    nbytes: int
    index: int
    at: float


@dataclass
class MooncakeJob:
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
    retried: set[int] = field(default_factory=set)  # descriptors submitted again after a stall (each once)

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


class MooncakeWrites:
    """The jobs of one transport, by peer, from ``admit`` to their callback.

    Threads: every method runs under the worker's step lock, one at a time
    (on the worker thread, or a scheduler's in ``pump()``), but :meth:`fail`
    of a job that never reached :meth:`admit` (on the opener's thread, or
    the closing one) and :meth:`held_bytes` (a racy read, for diagnostics).
    A round blocks on nothing: the engine's ``transfer_submit_write``
    queues and ``transfer_check_status`` only asks. Nothing raises: an
    engine's refusal or a failed descriptor fails its job (its callback gets
    a TransferError naming the peer); a callback's exception is logged."""

    def __init__(self, engine, config: EngineConfig) -> None:
        self._engine, self.config = engine, config
        self.num_descriptors = 0
        self.num_bytes = 0
        #: engine status checks so far (what completion tracking costs)
        self.num_status_checks = 0
        #: descriptors submitted again after the engine gave them up as stalled (:meth:`_retry`)
        self.num_retried = 0
        # Jobs by peer not fully submitted (by priority), descriptors and bytes outstanding per peer, and per
        # peer, oldest first, the Submitted records of its descriptors in the engine.
        self._by_peer: dict[str, collections.deque[MooncakeJob]] = collections.defaultdict(collections.deque)
        self._inflight: dict[str, int] = collections.defaultdict(int)
        self._inflight_peer_bytes: dict[str, int] = collections.defaultdict(int)
        self._outstanding: dict[str, collections.deque[tuple[int, MooncakeJob, int]]] = \
            collections.defaultdict(collections.deque)

    def held_bytes(self, peer: str) -> int:
        """The bytes of ``peer``'s descriptors in the engine now."""
        return self._inflight_peer_bytes.get(peer, 0)

    def admit(self, job: MooncakeJob) -> None:
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
        jobs.update({id(s.job): s.job for ids in self._outstanding.values() for s in ids})
        for job in jobs.values():
            self.fail(job)

    @staticmethod
    def fail(job: MooncakeJob, error: TransferError | None = None) -> None:
        if not job.done:
            end_job(job, error or closed_error(job.peer))

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
                    outstanding[peer].append(Submitted(tid, job, job.lengths[i], i, time.monotonic()))
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
            entry = ids.popleft()
            job, nbytes = entry.job, entry.nbytes
            status = check(entry.tid)
            self.num_status_checks += 1
            if status == 0:
                pending.append(entry)
                continue
            progressed = True
            if status != 1 and self._retry(entry, ids):
                continue
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

    def _retry(self, entry: Submitted, ids) -> bool:
        """Submit ``entry``'s descriptor once more when the engine
        gave it up as stalled: no progress on its connection for the engine's
        progress deadline (``progress_timeout_s``), after which Mooncake drops
        that connection and a new write opens a new one. Seen on a fresh
        peer's first writes: the peer's engine thread left a new connection
        unread (docs/reliability.md, "A stalled first write"). Once per
        descriptor, never for a cancelled job or a failure that came sooner (a refusal, a
        dead peer): those fail the job as before. The same bytes to the same
        place, with the source still held (the job has not ended): the write
        is idempotent, and decode reuses nothing before the job ends."""
        job, index = entry.job, entry.index
        stalled = time.monotonic() - entry.at >= 0.8 * self.config.progress_timeout_s
        if not stalled or job.cancelled or index in job.retried or job.error is not None:
            return False
        tid = self._engine.transfer_submit_write(job.peer, job.src[index], job.dst[index], job.lengths[index])
        if tid == 0:
            return False
        job.retried.add(index)
        self.num_retried += 1
        log.warning("write to %s: descriptor %d of %d (%d bytes) had no progress for %.1f s and Mooncake dropped its "
                    "connection; submitted once more on a new one", job.peer, index, len(job.src),
                    job.lengths[index], time.monotonic() - entry.at)
        ids.append(Submitted(tid, job, job.lengths[index], index, time.monotonic()))
        return True

    def _maybe_finish(self, job: MooncakeJob) -> None:
        if job.done or not job.finished:
            return
        if job.error is None:
            self.num_bytes += sum(job.lengths)
        end_job(job, job.error)
