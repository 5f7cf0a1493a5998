"""What a Mooncake transport tells its peers in kvferry's handshake
(``PeerHello.transport_meta``), and the checks on what it is told. Pure:
imports neither Mooncake nor torch.

A decode rank's blob carries its metadata mode (``relay`` or ``p2p``, which
both sides must share: :mod:`transfer.transport.mooncake.relay`), in relay
mode the entries Mooncake published for its segment, and its probe region:
a few bytes of registered memory that a prefill rank writes when it opens
the way to this rank, so that the open exercises the whole data path (the
segment lookup, on RDMA the endpoints, the data connection) before any
room's bytes follow. Encoded as ``b"KVFM" | version (1 byte) | msgpack map``.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from transfer.errors import IncompatibleTransportError, ProtocolError

MAGIC = b"KVFM"
VERSION = 1
MODES = ("relay", "p2p")


@dataclass(frozen=True)
class MooncakePeerMeta:
    mode: str
    probe_addr: int
    probe_bytes: int
    entries: tuple[tuple[str, str], ...] = ()  # relay: Mooncake's (key, value) pairs of the segment

    def encode(self) -> bytes:
        body = {"mode": self.mode, "probe": [self.probe_addr, self.probe_bytes], "entries": dict(self.entries)}
        return MAGIC + bytes([VERSION]) + msgpack.packb(body, use_bin_type=True)


def decode_peer_meta(blob: bytes) -> MooncakePeerMeta:
    """A peer's blob; ProtocolError when it is not one this version writes."""
    if len(blob) < 5 or blob[:4] != MAGIC:
        raise ProtocolError(f"not kvferry Mooncake peer metadata ({len(blob)} bytes, starting {bytes(blob[:4])!r})")
    if blob[4] != VERSION:
        raise ProtocolError(f"Mooncake peer metadata version {blob[4]} (this side reads {VERSION})")
    try:
        body = msgpack.unpackb(blob[5:], raw=False)
        mode, (addr, nbytes), entries = body["mode"], body["probe"], body["entries"]
    except Exception as exc:
        raise ProtocolError(f"malformed Mooncake peer metadata: {type(exc).__name__}: {exc}") from exc
    if mode not in MODES:
        raise ProtocolError(f"Mooncake peer metadata: unknown mode {mode!r}", field="mode")
    if not (isinstance(addr, int) and isinstance(nbytes, int) and addr >= 0 and 0 <= nbytes <= 4096):
        raise ProtocolError(f"Mooncake peer metadata: bad probe region {addr!r}, {nbytes!r}", field="probe")
    if not isinstance(entries, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in entries.items()):
        raise ProtocolError("Mooncake peer metadata: entries must map text keys to text values", field="entries")
    return MooncakePeerMeta(mode=mode, probe_addr=addr, probe_bytes=nbytes, entries=tuple(sorted(entries.items())))


def check_peer_meta(meta: MooncakePeerMeta, session: str, local_mode: str) -> None:
    """Refuse a peer this side cannot open: another metadata mode
    (IncompatibleTransportError, field ``transport.mooncake_metadata``), or
    relayed entries that are not the peer's own (ProtocolError: a peer may
    only describe its own segment, never another one's, nor this rank's)."""
    if meta.mode != local_mode:
        raise IncompatibleTransportError(
            "transport.mooncake_metadata", local_mode, meta.mode,
            detail="both sides of a room must set EngineConfig.mooncake_metadata (KVFERRY_MOONCAKE_METADATA) alike")
    if local_mode == "relay" and not meta.entries:
        raise ProtocolError(f"peer {session} relayed no Mooncake segment entries", field="entries")
    foreign = [k for k, _ in meta.entries if not k.endswith("/" + session)]
    if foreign:
        raise ProtocolError(f"peer {session} relayed Mooncake entries of another segment: {foreign[:3]}",
                            field="entries")
