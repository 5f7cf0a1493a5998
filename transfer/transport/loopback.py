"""An in-process transport and network for unit tests: several managers of one
process share a :class:`LoopbackFabric`.

:class:`LoopbackTransport` keeps the contract of :mod:`transfer.transport.base`:
a worker thread copies each descriptor with ``memmove``, after checking that
the source lies in memory this transport registered and the destination in
memory the peer registered (a TransferError otherwise, as a remote engine
would refuse; also after the peer unregistered it); the callback runs once, on the worker thread, after the last
descriptor. Host memory only (a CUDA pointer cannot be memmoved). The
fabric also routes the control messages of
:class:`~transfer.control.loopback.LoopbackChannel` s.

Faults, for tests: ``hold_writes`` / ``release_writes`` stop and resume every
transport before its next descriptor (a write "in flight"); ``hold_opens`` /
``release_opens`` hold every transport's peer opens (a stalled handshake); ``break_writes``
fails the writes to a session; ``hold`` / ``release`` keep the messages to an
endpoint queued; ``cut`` / ``mend`` drop every message to and from an
endpoint (a lost peer); ``drop_if`` drops the messages a predicate picks;
``delay_s`` delays every delivery; ``validate_on_submit`` checks a
plan's destinations when it is submitted, not before each copy, as
Mooncake's TCP transport does (an accepted write lands even into memory
unregistered since).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable

from transfer.control.base import ChannelOptions, Handler, Link
from transfer.control.loopback import LoopbackChannel, origin_of
from transfer.errors import KVFerryError, TransferError
from transfer.plan import TransferPlan
from transfer.transport.base import DoneCallback
from transfer.transport.worker import PollingWorker, closed_error, end_job, gate_state

log = logging.getLogger("kvferry.transport")


@dataclass
class _Job:
    peer: str
    plan: TransferPlan
    callback: DoneCallback
    cancelled: bool = False
    ready: object = None  # a transfer.ready.ReadyGate, waited for on the worker
    accepted: bool = False  # destinations checked at submit (``validate_on_submit``)
    done: bool = False

    def cancel(self) -> None:
        self.cancelled = True


def _inside(regions: list[tuple[int, int]], addr: int, nbytes: int) -> bool:
    return any(base <= addr and addr + nbytes <= base + size for base, size in regions)


class LoopbackTransport:
    kind = "loopback"
    peer_metadata = None  # the fabric knows every transport

    def __init__(self, fabric: LoopbackFabric, session: str, handshake_timeout_s: float = 5.0) -> None:
        self.session = session
        self._fabric = fabric
        self.regions: list[tuple[int, int]] = []
        self.num_bytes = 0
        self.num_descriptors = 0
        self._held: list[_Job] = []  # the worker's: jobs whose ready gate is not done
        self._worker = PollingWorker(self, open_timeout_s=handshake_timeout_s)
        self._closed = self._worker.closed

    def describe(self) -> str:
        return f"loopback memmove (session {self.session})"

    def register(self, regions: list[tuple[int, int]]) -> None:
        self.regions.extend((int(a), int(n)) for a, n in regions)

    def unregister(self, regions: list[tuple[int, int]]) -> None:
        """Writes into these regions (by address) are refused from now on."""
        gone = {int(a) for a, _ in regions}
        self.regions = [r for r in self.regions if r[0] not in gone]

    def submit(self, peer: str, plan: TransferPlan, callback: DoneCallback, ready,
               priority: float = 0.0) -> _Job | None:
        self._worker.check_open()
        if plan.num_descriptors == 0:
            callback(None)
            return None
        job = _Job(peer, plan, callback, ready=ready)
        target = self._fabric.transport_of(peer)
        if self._fabric.validate_on_submit and target is not None:
            job.accepted = all(_inside(target.regions, d, n) for d, n in
                               zip(plan.dst_addrs.tolist(), plan.lengths.tolist(), strict=True))
        self._worker.put(job)
        return job

    def open_peer(self, peer: str, blob: bytes, callback=None) -> None:
        """Open the way to ``peer`` (see :mod:`transfer.transport.base`): the
        fabric reaches every transport at once, so the opener's call only
        waits while the fabric's ``hold_opens`` is set (a test's stalled handshake)."""
        self._worker.opener.open(peer, blob, callback)

    def open(self, peer: str, blob: bytes, pause) -> None:
        """The opener's engine call: nothing to open, but a held handshake
        (which holds no engine lock: other peers' copies go on)."""
        while not self._fabric.opens_open.wait(0.02):
            if self._closed.is_set():
                raise TransferError(f"transport closed while opening the way to {peer}", peer=peer)

    def describe_open(self, link) -> str:
        return "the test holds the fabric's handshakes" if not self._fabric.opens_open.is_set() else ""

    def handshake_counts(self) -> dict[str, float]:
        return self._worker.opener.counters()

    def describe_job(self, job: _Job) -> str:
        """Where a plan :meth:`submit` took stands, and the worker's health (for a failure's message)."""
        what = (f"write to {job.peer} ended" if job.done
                else f"write to {job.peer} of {job.plan.num_descriptors} descriptor(s): not copied yet")
        return f"{what}; {self._worker.health()}"

    def pump(self) -> None:
        """Nothing: the loopback copies on its worker only (a held write would
        block the caller: the tests hold writes from the thread that polls)."""

    # --- the worker's side (transfer.transport.worker.EngineSide) -------------------

    def admit(self, job: _Job) -> None:
        self._held.append(job)

    def step(self, may_submit: bool) -> tuple[int, bool]:
        """Copy every job whose ready gate is done, in order (a late event
        holds back its own job only; nothing while a peer open holds the engine)."""
        held, self._held = self._held, []
        for job in held:
            waiting = not self._closed.is_set() and (not may_submit or gate_state(job.ready, job.peer)[0])
            if waiting and job.cancelled:  # never started: nothing to wait for
                self._end(job, TransferError(f"transfer to {job.peer} cancelled", peer=job.peer))
            elif waiting:
                self._held.append(job)
            else:
                self._end(job, self._copy(job))
        return 0, bool(self._held)

    @staticmethod
    def _end(job: _Job, error: TransferError | None) -> None:
        end_job(job, error)

    def fail(self, job: _Job, error: TransferError | None = None) -> None:
        self._end(job, error or closed_error(job.peer))

    def idle(self) -> None:
        """Nothing accumulates here without jobs."""

    def fail_all(self) -> None:
        held, self._held = self._held, []
        for job in held:
            self.fail(job)

    def _copy(self, job: _Job) -> TransferError | None:
        plan = job.plan
        if job.ready is not None:
            try:
                job.ready.wait()  # on the worker: bounded by the gate's deadline
            except KVFerryError as exc:
                return TransferError(str(exc), peer=job.peer)
            job.ready = None
        for i, (src, dst, n) in enumerate(zip(plan.src_addrs.tolist(), plan.dst_addrs.tolist(),
                                             plan.lengths.tolist(), strict=True)):
            while not self._fabric.writes_open.wait(0.02):
                if self._closed.is_set():
                    break
            if self._closed.is_set():
                return closed_error(job.peer)
            if job.cancelled:
                return TransferError(f"transfer to {job.peer} cancelled", peer=job.peer)
            peer = self._fabric.transport_of(job.peer)
            if peer is None or job.peer in self._fabric.broken:
                return TransferError(f"write to {job.peer} failed: no such peer (loopback)", peer=job.peer)
            if not _inside(self.regions, src, n):
                return TransferError(f"descriptor {i}: source [{src:#x}, +{n}) is not registered here",
                                     peer=job.peer)
            if not job.accepted and not _inside(peer.regions, dst, n):
                return TransferError(f"descriptor {i}: destination [{dst:#x}, +{n}) is outside the memory "
                                     f"{job.peer} registered", peer=job.peer)
            ctypes.memmove(dst, src, n)
            self.num_descriptors += 1
        self.num_bytes += plan.total_bytes
        return None

    def close(self, timeout_s: float = 5.0) -> None:
        if self._worker.close(timeout_s):
            self._fabric.unbind_transport(self.session)


class LoopbackFabric:
    """What the managers of one test share: transports by session, channels by
    endpoint, and the faults the test sets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._transports: dict[str, LoopbackTransport] = {}
        self._channels: dict[str, LoopbackChannel] = {}
        self.writes_open = threading.Event()
        self.writes_open.set()
        self.opens_open = threading.Event()  # cleared: every transport's peer opens wait (a held handshake)
        self.opens_open.set()
        self.broken: set[str] = set()
        self._held: dict[str, list[tuple[bytes, str]]] = {}
        self._cut: set[str] = set()
        self._gone: set[str] = set()  # endpoints of channels that closed
        self._drop_if: Callable[[object], bool] | None = None
        self.delay_s = 0.0
        self.num_dropped = 0
        self.validate_on_submit = False

    # --- building -----------------------------------------------------------------

    def transport(self, host: str = "127.0.0.1", handshake_timeout_s: float = 5.0) -> LoopbackTransport:
        """A new transport (pass it to ``KVManager(..., transport=)``); its
        session is ``HOST:N``, like a Mooncake session on that host."""
        t = LoopbackTransport(self, f"{host}:{next(self._ids)}", handshake_timeout_s)
        with self._lock:
            self._transports[t.session] = t
        return t

    def channel(self, options: ChannelOptions, handler: Handler) -> LoopbackChannel:
        """A :data:`~transfer.control.base.ChannelFactory` (pass ``fabric.channel``
        as ``KVManager(..., channel_factory=)``)."""
        endpoint = f"loopback://{options.host}/{next(self._ids)}"
        ch = LoopbackChannel(self, endpoint, handler, options.secret)
        with self._lock:
            self._channels[endpoint] = ch
        return ch

    def transport_of(self, session: str) -> LoopbackTransport | None:
        with self._lock:
            return self._transports.get(session)

    def unbind_transport(self, session: str) -> None:
        with self._lock:
            self._transports.pop(session, None)

    def unbind(self, endpoint: str) -> None:
        with self._lock:
            if self._channels.pop(endpoint, None) is not None:
                self._gone.add(endpoint)

    # --- messages -----------------------------------------------------------------

    def route(self, src: str, dst: str, payload: bytes, msg=None) -> None:
        with self._lock:
            if src in self._cut or dst in self._cut:
                self.num_dropped += 1
                return
            if self._drop_if is not None and msg is not None and self._drop_if(msg):
                self.num_dropped += 1
                return
            if dst in self._held:
                self._held[dst].append((payload, origin_of(src)))
                return
            ch = self._channels.get(dst)
        if ch is not None:
            ch.deliver(payload, time.monotonic() + self.delay_s, origin_of(src))

    def link(self, src: str, dst: str) -> Link:
        """UP: messages from ``src`` reach ``dst`` (it is bound, neither is
        cut, it is not held); GONE: ``dst`` was bound and closed; DOWN: cut
        or held; UNKNOWN: never bound."""
        with self._lock:
            if dst in self._gone:
                return Link.GONE
            if dst not in self._channels:
                return Link.UNKNOWN
            return Link.DOWN if src in self._cut or dst in self._cut or dst in self._held else Link.UP

    def inject(self, dst: str, payload: bytes, origin: str = "127.0.0.1") -> None:
        """Deliver raw bytes to ``dst`` as if from ``origin`` (malformed or
        forged input, for tests)."""
        with self._lock:
            ch = self._channels.get(dst)
        if ch is not None:
            ch.deliver(payload, origin=origin)

    # --- faults -------------------------------------------------------------------

    def hold_opens(self) -> None:
        self.opens_open.clear()

    def release_opens(self) -> None:
        self.opens_open.set()

    def hold_writes(self) -> None:
        """Transports stop before their next descriptor (writes stay in flight)."""
        self.writes_open.clear()

    def release_writes(self) -> None:
        self.writes_open.set()

    def break_writes(self, session: str) -> None:
        """Writes to ``session`` fail from now on."""
        self.broken.add(session)

    def hold(self, endpoint: str) -> None:
        """Keep messages to ``endpoint`` queued until :meth:`release`."""
        with self._lock:
            self._held.setdefault(endpoint, [])

    def release(self, endpoint: str) -> None:
        with self._lock:
            held = self._held.pop(endpoint, [])
            ch = self._channels.get(endpoint)
        for payload, origin in held:
            if ch is not None:
                ch.deliver(payload, origin=origin)

    def cut(self, endpoint: str) -> None:
        """Drop every message to and from ``endpoint`` (a peer lost, or one that lost us)."""
        with self._lock:
            self._cut.add(endpoint)

    def mend(self, endpoint: str) -> None:
        with self._lock:
            self._cut.discard(endpoint)

    def drop_if(self, predicate: Callable[[object], bool] | None) -> None:
        """Drop the messages for which ``predicate(msg)`` is true (None: none)."""
        with self._lock:
            self._drop_if = predicate
