"""How a Mooncake transport names its engine, learns its peers' segments,
and opens the way to a peer before any plan goes there (the
:class:`~transfer.transport.worker.EngineSide` ``open`` of
:class:`~transfer.transport.mooncake.transport.MooncakeTransport`).

``relay`` (``EngineConfig.mooncake_metadata``, the default): the engine's
metadata server is this process's relay store
(:mod:`transfer.transport.mooncake.relay`), its segment is named
``host:kvferry-<random>``, and a peer's entries, carried by kvferry's
handshake, go into the store before the open. ``p2p``: Mooncake's
``P2PHANDSHAKE``, the segment named ``host:<handshake port>``.

The open is a probe write of :data:`PROBE_BYTES` into the region the peer's
handshake named: the engine opens the segment inside that write's submit
(relay: a lookup in the store; P2P: a handshake with the peer's listener,
under the engine's one mutex, hence inside ``pause()``), connects its data
path and, on RDMA, builds the endpoints. Where an earlier peer had the same
address and data port (a restarted peer got its old port back, and the dead
process's connections are still pooled; P2P: always, the port is not known
here), bursts of :data:`PROBE_BURST` probes follow until one lands whole, so
that every pooled data connection works before any room's bytes follow.
"""

from __future__ import annotations

import json
import logging
import secrets
import time

import numpy as np

from transfer.config import EngineConfig
from transfer.errors import HandshakeError, TransferError
from transfer.transport.mooncake.peer_meta import MooncakePeerMeta, decode_peer_meta
from transfer.transport.peers import PeerLink

log = logging.getLogger("kvferry.transport")

PROBE_BYTES = 64
#: Probe writes in flight at once after the first: more than the engine's data connections per peer
#: (``MC_TCP_LANES_PER_PEER``, 4 by default), so that a burst reaches each of them.
PROBE_BURST = 8
#: Bursts after which a peer whose probes keep failing is given up (its HandshakeError says so).
MAX_PROBE_ROUNDS = 8


def data_address(meta: MooncakePeerMeta) -> tuple[str, int] | None:
    """(host, TCP data port) a relayed peer's writes connect to, which the
    engine pools its connections by (None: not relayed, or not TCP)."""
    host = port = None
    try:
        for key, value in meta.entries:
            body = json.loads(value)
            if "/rpc_meta/" in key:
                host = body.get("ip_or_host_name")
            elif body.get("tcp_data_port"):
                port = int(body["tcp_data_port"])
    except (ValueError, TypeError, AttributeError):
        return None
    return (host, port) if host and port else None


class MooncakePeers:
    """One engine's name, metadata mode, probe region and the peers it opened."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.mode = config.mooncake_metadata
        self.store = None
        if self.mode == "relay":
            from transfer.transport.mooncake.relay import relay_store
            self.store = relay_store()
        # The probe region a peer writes when it opens the way to this rank (and the source of this
        # rank's own probes): registered with the engine, so that an RDMA write from or into it is valid.
        self._probe_buf = np.zeros(PROBE_BYTES, dtype=np.uint8)
        self.probe_addr = int(self._probe_buf.ctypes.data)
        #: peers whose segment the engine opened (their probe write landed)
        self.opened: set[str] = set()
        self._phase: dict[str, str] = {}  # peer -> what its open is doing now, for a late open's message
        self._addresses: set[tuple[str, int]] = set()  # (host, data port) of every relayed peer opened
        self._engine = None
        self.session = ""
        #: probe writes that failed on a connection the engine had pooled for a dead process at the same
        #: address and port (a restarted peer), before a burst of them all landed
        self.num_stale_writes = 0

    def initialize(self, engine) -> None:
        """Initialize ``engine`` (a Mooncake ``TransferEngine``) for this mode
        and register the probe region; sets :attr:`session`."""
        c = self.config
        if self.store is not None:
            # A new name per engine: a restarted peer is never taken for its old engine.
            name, server, said = f"{c.hostname}:kvferry-{secrets.token_hex(8)}", self.store.url, "kvferry relay"
        else:
            name, server, said = c.hostname, "P2PHANDSHAKE", "P2PHANDSHAKE"
        rc = engine.initialize(name, server, c.protocol, c.device_name)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({name!r}, {said}, {c.protocol!r}) returned {rc}", code=rc)
        self._engine = engine
        self.session = name if self.store is not None else f"{c.hostname}:{engine.get_rpc_port()}"
        rc = engine.batch_register_memory([self.probe_addr], [PROBE_BYTES])
        if rc != 0:
            raise TransferError(f"registering the probe region with Mooncake returned {rc}", code=rc)

    def own_meta(self) -> bytes:
        """What a peer needs to open the way here (relay: the entries the
        engine published for this segment, as they are now: call it again
        after the registered memory changed)."""
        entries = tuple(sorted(self.store.entries(self.session).items())) if self.store is not None else ()
        return MooncakePeerMeta(mode=self.mode, probe_addr=self.probe_addr, probe_bytes=PROBE_BYTES,
                                entries=entries).encode()

    def open(self, peer: str, blob: bytes, pause) -> None:
        """The opener's engine call (see the module docstring): relay, the
        peer's entries into the store; then, the first time, the probe
        write. A peer that sent no blob: a zero-length write (P2P only: it
        opens the segment). Raises HandshakeError naming the peer."""
        meta = decode_peer_meta(blob) if blob else None
        if self.store is not None:
            if meta is None:
                raise HandshakeError(f"no Mooncake segment of {peer} was relayed to this rank: its handshake "
                                     "carried none (only ranks that handshook can be written to)", peer=peer)
            self._phase[peer] = "relay"
            self.store.put(dict(meta.entries))
        if peer in self.opened:
            self._phase.pop(peer, None)
            return  # again with new metadata: the store has it (the engine checks addresses at the peer)
        self._phase[peer] = "segment"
        dst, nbytes = (meta.probe_addr, meta.probe_bytes) if meta is not None else (0, 0)
        give_up = time.monotonic() + self.config.handshake_timeout_s + 1.0
        statuses = self._probe(peer, dst, nbytes, 1, pause, give_up)  # the first submit opens the segment
        address = data_address(meta) if meta is not None else None
        if statuses == [1] and address is not None and address not in self._addresses:
            statuses = [1] * PROBE_BURST  # no earlier peer had this address and port: nothing stale is pooled
        if address is not None:
            self._addresses.add(address)
        # Else a burst that reaches every data connection: the engine pools its connections by the peer's
        # address and data port, and a restarted peer that got its old port back finds the dead process's
        # connections still pooled; each fails one write (measured: a probe of a peer reusing a port failed
        # with "failed to read WRITE ack frame", the next write of the same connection succeeded). So
        # burst until every probe of a burst landed, before any room's bytes take those connections.
        rounds, stale_before = 0, self.num_stale_writes
        while nbytes and not (statuses == [1] * len(statuses) and len(statuses) == PROBE_BURST):
            if 0 in statuses or rounds == MAX_PROBE_ROUNDS or time.monotonic() > give_up:
                raise HandshakeError(
                    f"the probe write of {nbytes} bytes to {peer} "
                    f"{'is still pending' if 0 in statuses else 'failed'} (Mooncake statuses {statuses} in "
                    f"{rounds + 1} round(s); its data port is unreachable, or the peer does not answer)",
                    peer=peer, code=next((st for st in statuses if st != 1), None))
            rounds += 1
            self.num_stale_writes += statuses.count(-1)
            statuses = self._probe(peer, dst, nbytes, PROBE_BURST, None, give_up)
        if not nbytes and statuses != [1]:
            raise HandshakeError(f"Mooncake could not open the segment of {peer} (status {statuses})", peer=peer)
        if self.num_stale_writes > stale_before:
            log.warning("opening the way to %s: %d probe write(s) failed on data connections the engine still "
                        "pooled for an earlier process at the same address and port (a restarted peer that got its "
                        "old port back); Mooncake reconnected them after its 1 s cool-down", peer,
                        self.num_stale_writes - stale_before)
        self.opened.add(peer)
        self._phase.pop(peer, None)

    def _probe(self, peer: str, dst: int, nbytes: int, count: int, pause, give_up: float) -> list[int]:
        """``count`` probe writes at once; their statuses (1 landed, 0 still
        pending at ``give_up``, negative failed). The submits run inside
        ``pause()`` when given (the first opens the segment)."""
        submit = self._engine.transfer_submit_write
        if pause is not None:
            with pause():
                tids = [submit(peer, self.probe_addr, dst, nbytes) for _ in range(count)]
        else:
            tids = [submit(peer, self.probe_addr, dst, nbytes) for _ in range(count)]
        if 0 in tids:
            raise HandshakeError(f"Mooncake could not open the segment of {peer} ({self.how_opened(peer)})",
                                 peer=peer)
        self._phase[peer] = "probe"
        statuses = [0] * count
        wait = 2e-4
        while 0 in statuses and time.monotonic() < give_up:
            statuses = [st if st else self._engine.transfer_check_status(tid) for tid, st in zip(tids, statuses, strict=True)]
            if 0 in statuses:
                time.sleep(wait)
                wait = min(wait * 2, 5e-3)
        return statuses

    def how_opened(self, peer: str) -> str:
        """How the engine opens ``peer``'s segment, in words."""
        if self.store is not None:
            return "a lookup of its relayed descriptor in kvferry's metadata store"
        return (f"Mooncake's P2P handshake with its listener at {peer}, which serves one connection at a time: "
                "each connection ahead of it, an idle one from a port scanner or a health check that does not "
                "close among them, holds it up to 5 s")

    def describe_open(self, link: PeerLink) -> str:
        """What the engine is doing for an open past its deadline."""
        phase = self._phase.get(link.peer, "")
        if phase == "relay":
            return "putting its relayed descriptor into kvferry's metadata store"
        if phase == "segment":
            return f"the engine is opening its segment by {self.how_opened(link.peer)}"
        if phase == "probe":
            return "the probe write into its memory is still pending (its data port does not answer)"
        return "not started yet"
