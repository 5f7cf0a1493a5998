"""The Mooncake transport: with :mod:`~transfer.transport.mooncake.peer_open`
(which opens its peers) and :mod:`~transfer.transport.mooncake.writes` (which
moves its plans), the only code of ``transfer`` that talks to the Mooncake
transfer engine. It keeps the contract of :mod:`transfer.transport.base`.

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
where the plans of each peer go lowest ``priority`` (the oldest room) first
(:mod:`transfer.transport.mooncake.writes`, the worker's side).

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

import logging

from transfer.config import EngineConfig
from transfer.errors import TransferError
from transfer.plan import TransferPlan, split_entries
from transfer.transport.base import DoneCallback
from transfer.transport.mooncake.peer_meta import check_peer_meta, decode_peer_meta
from transfer.transport.mooncake.peer_open import MooncakePeers
from transfer.transport.peers import OpenCallback
from transfer.transport.mooncake.process import (apply_mooncake_env, keep_forever, quiet_engine_start, rdma_devices,
                                                 reserve_fd_table, stderr_discarded)
from transfer.transport.mooncake.writes import MooncakeJob, MooncakeWrites
from transfer.transport.worker import PollingWorker, close_at_exit

log = logging.getLogger("kvferry.transport")


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
        reserve_fd_table()  # before the engine's I/O thread accepts its first data connection
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
        #: the worker's engine side: the jobs by peer, from admit to their callback; self.peers opens its peers
        self._writes = MooncakeWrites(self._engine, config)
        self._worker = PollingWorker(self._writes, open_timeout_s=config.handshake_timeout_s, opens=self.peers)
        close_at_exit(self)

    @property
    def num_rounds(self) -> int:
        """Worker rounds so far (what completion tracking costs)."""
        return self._worker.num_rounds

    @property
    def num_status_checks(self) -> int:
        """Engine status checks so far (what completion tracking costs)."""
        return self._writes.num_status_checks

    @property
    def num_descriptors(self) -> int:
        return self._writes.num_descriptors

    @property
    def num_bytes(self) -> int:
        return self._writes.num_bytes

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

    def handshake_counts(self) -> dict[str, float]:
        """The opener's counters (see :meth:`~transfer.transport.opener.PeerOpener.counters`), and
        ``handshake_stale_writes`` (:attr:`~transfer.transport.mooncake.peer_open.MooncakePeers.num_stale_writes`)."""
        return {**self._worker.opener.counters(), "handshake_stale_writes": self.peers.num_stale_writes}

    # --- transfers --------------------------------------------------------------

    def submit(self, peer: str, plan: TransferPlan, callback: DoneCallback, ready,
               priority: float = 0.0) -> MooncakeJob | None:
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
        job = MooncakeJob(peer, plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.lengths.tolist(), callback,
                          ready=ready, priority=priority)
        self._worker.put(job)
        return job

    def pump(self) -> None:
        """Move this transport's work along on the caller's thread (see
        :mod:`transfer.transport.base`)."""
        self._worker.pump()

    def describe_job(self, job: MooncakeJob) -> str:
        """Where a plan :meth:`submit` took stands, and the worker's health (for a failure's message)."""
        opening = self._worker.opener.describe_peer(job.peer)
        first = f"; {opening}" if opening else ""
        held = self._writes.held_bytes(job.peer)
        link = f"; {held} bytes to {job.peer} in the engine (at most {self.config.inflight_bytes_per_peer})"
        return f"{job.status()}{link}; {self._worker.health()}{first}"

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the worker (outstanding jobs fail) and unregister memory."""
        if not self._worker.close(timeout_s):
            return
        if self._registered:
            self._engine.batch_unregister_memory(self._registered)
            self._registered = []
        keep_forever(self._engine)  # see the module docstring: its destructor costs ~1 s with the GIL held

