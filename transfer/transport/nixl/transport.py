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
``_MAX_DESCS_PER_REQUEST``), posted and polled on the worker thread
(:mod:`transfer.transport.nixl.writes`, the worker's side); NIXL and UCX
handle many small descriptors in one request, so nothing is split into
per-descriptor writes.

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

from transfer.config import EngineConfig
from transfer.errors import HandshakeError, TransferError
from transfer.plan import TransferPlan
from transfer.transport.base import DoneCallback
from transfer.transport.nixl.api import backend_params, import_api, new_agent
from transfer.transport.nixl.peers import decode_metadata, encode_metadata
from transfer.transport.nixl.writes import NixlJob, NixlPeer, NixlWrites
from transfer.transport.peers import OpenCallback, PeerLink
from transfer.transport.worker import PollingWorker, close_at_exit

log = logging.getLogger("kvferry.transport")

_agent_ids = itertools.count()


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
        self._peers: dict[str, NixlPeer] = {}
        #: the worker's engine side: the jobs, from admit to their callback; this transport opens its peers
        self._writes = NixlWrites(self._agent, config, memory, device_id, self._peer)
        self._worker = PollingWorker(self._writes, open_timeout_s=config.handshake_timeout_s, opens=self)
        close_at_exit(self)

    @property
    def num_bytes(self) -> int:
        return self._writes.num_bytes

    @property
    def num_descriptors(self) -> int:
        return self._writes.num_descriptors

    @property
    def num_requests(self) -> int:
        """NIXL transfer requests posted so far."""
        return self._writes.num_requests

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
            self._peers[peer] = NixlPeer(name, regions)

    def _peer(self, peer: str) -> NixlPeer | None:
        """The peer :meth:`open` loaded last (None: none), for a write (the worker's)."""
        with self._lock:
            return self._peers.get(peer)

    def describe_open(self, link: PeerLink) -> str:
        """What NIXL is doing for an open past its deadline."""
        return "NIXL is loading its agent's metadata and connecting to it (UCX wire-up)"

    def handshake_counts(self) -> dict[str, float]:
        """The opener's counters (see :meth:`~transfer.transport.opener.PeerOpener.counters`)."""
        return self._worker.opener.counters()

    # --- transfers --------------------------------------------------------------

    def submit(self, peer: str, plan: TransferPlan, callback: DoneCallback, ready,
               priority: float = 0.0) -> NixlJob | None:
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
        job = NixlJob(peer, plan, callback, ready=ready)
        self._worker.put(job)
        return job

    def pump(self) -> None:
        """Move this transport's work along on the caller's thread (see
        :mod:`transfer.transport.base`)."""
        self._worker.pump()

    def describe_job(self, job: NixlJob) -> str:
        """Where a plan :meth:`submit` took stands, and the worker's health (for a failure's message)."""
        return f"{job.status()}; {self._worker.health()}"

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
