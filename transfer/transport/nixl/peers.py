"""What a NIXL transport tells its peers, and what it keeps of theirs
(:mod:`transfer.transport.nixl.transport`). Pure: imports neither NIXL nor torch.

A peer that writes needs the target agent's NIXL metadata (connection
information and the keys of its registered memory). kvferry carries it in
its own, authenticated handshake (``PeerHello.transport_meta``), not through
NIXL's listener thread, which binds every interface and answers anyone. The
blob is::

    b"KVFN" | version (1 byte) | num_regions (4 bytes, LE) |
    num_regions x (addr, nbytes) as little-endian uint64 | NIXL metadata

The regions are the target's registered memory *now*. The writer refuses a
descriptor outside them before posting anything: NIXL itself checks a
write against the metadata it loaded, which only ever grows (loading newer
metadata adds sections, it never drops a deregistered one), and UCX lands a
write into memory its target deregistered (measured, docs/reliability.md).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from transfer.errors import ProtocolError

MAGIC = b"KVFN"
VERSION = 1
_HEAD = struct.Struct("<4sBI")


def encode_metadata(agent_metadata: bytes, regions: list[tuple[int, int]]) -> bytes:
    """The blob a peer loads with :func:`decode_metadata`."""
    table = np.asarray(sorted(regions), dtype="<u8").reshape(-1, 2)
    return _HEAD.pack(MAGIC, VERSION, len(table)) + table.tobytes() + agent_metadata


def decode_metadata(blob: bytes) -> tuple[bytes, PeerRegions]:
    """``(agent_metadata, regions)`` of a peer's blob; ProtocolError when it
    is not one this version writes."""
    if len(blob) < _HEAD.size:
        raise ProtocolError(f"NIXL peer metadata of {len(blob)} bytes is too short")
    magic, version, num = _HEAD.unpack_from(blob)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not kvferry NIXL peer metadata (magic {magic!r}, version {version})")
    end = _HEAD.size + 16 * num
    if len(blob) <= end:
        raise ProtocolError(f"NIXL peer metadata truncated: {num} regions and no agent metadata in {len(blob)} bytes")
    table = np.frombuffer(blob, dtype="<u8", count=2 * num, offset=_HEAD.size).reshape(-1, 2).astype(np.int64)
    return bytes(blob[end:]), PeerRegions(table[:, 0], table[:, 0] + table[:, 1])


@dataclass(frozen=True)
class PeerRegions:
    """A peer's registered regions ``[starts[i], ends[i])``, sorted by start."""

    starts: np.ndarray
    ends: np.ndarray

    def first_outside(self, addrs: np.ndarray, lengths: np.ndarray) -> int:
        """The index of the first ``[addrs[i], +lengths[i])`` not inside one
        region, or -1 when every one is (vectorised)."""
        if addrs.size == 0:
            return -1
        addrs = addrs.astype(np.int64, copy=False)
        if self.starts.size == 0:
            return 0
        i = np.searchsorted(self.starts, addrs, side="right") - 1
        inside = (i >= 0) & (addrs + lengths.astype(np.int64, copy=False) <= self.ends[np.maximum(i, 0)])
        bad = np.flatnonzero(~inside)
        return int(bad[0]) if bad.size else -1
