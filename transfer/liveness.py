"""Peer liveness: which peers to ping, and which have gone silent. Pure.

Each rank watches the peers it has live rooms with (decode: the prefill
ranks a room still awaits; prefill: the decode ranks whose requests it
holds). Every ``interval_s`` it pings each watched peer, and any answer
counts as a sign of life. A peer silent for ``timeout_s`` is reported lost
once (process killed, host gone, process stopped or wedged): the caller
fails its rooms and forgets its links, so a peer that comes back is used
again after a fresh lookup and handshake; nothing is blacklisted.

A peer the caller knows to be gone (its address refuses connections: the
process there exited or was killed) is lost once silent for ``interval_s``,
without waiting out ``timeout_s``.

A peer that stops being watched is forgotten, and the next time it is
watched starts with a full ``timeout_s`` of grace.

Silence is counted on the watcher's own clock of watching: the caller steps
every ``interval_s`` or sooner, and time beyond ``interval_s`` between two
steps is a pause of the watcher (its process stopped or starved, its host
paused), when nothing it could have heard was taken in. That time is
credited to every peer, so a watcher that runs again judges its peers by
what it hears from then on: a peer that answers is not lost for the
watcher's own pause, and one that stays silent is lost once it has been
watched for ``timeout_s`` in all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Peer:
    endpoint: str
    heard: float
    pinged: float = float("-inf")


class Liveness:
    """Not thread-safe: the owner calls it from one thread or under a lock."""

    def __init__(self, interval_s: float, timeout_s: float) -> None:
        if not 0 < interval_s < timeout_s:
            raise ValueError(f"need 0 < interval_s ({interval_s}) < timeout_s ({timeout_s})")
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._peers: dict[str, _Peer] = {}
        self._stepped: float | None = None  # when the last step ran
        self.last_pause_s = 0.0  # the watcher's pause the last step credited (see the module docstring)

    @property
    def num_watched(self) -> int:
        """Peers under watch now (those of the last ``step``)."""
        return len(self._peers)

    def heard(self, session: str, now: float) -> None:
        """A message from ``session`` arrived."""
        peer = self._peers.get(session)
        if peer is not None:
            peer.heard = max(peer.heard, now)

    def silent_for(self, session: str, now: float) -> float:
        peer = self._peers.get(session)
        return 0.0 if peer is None else now - peer.heard

    def step(self, watched: dict[str, str], now: float, gone=frozenset()) -> tuple[list[tuple[str, str]], list[str]]:
        """``watched``: session -> control endpoint of each peer with live
        rooms; ``gone``: sessions known gone. Returns the (session, endpoint)
        pairs to ping now, and the sessions lost (silent for ``timeout_s``,
        or gone and silent for ``interval_s``, less the watcher's pauses),
        each reported once."""
        for session in self._peers.keys() - watched.keys():
            del self._peers[session]
        self.last_pause_s = 0.0 if self._stepped is None else max(0.0, now - self._stepped - self.interval_s)
        if self.last_pause_s:
            for peer in self._peers.values():
                peer.heard = min(now, peer.heard + self.last_pause_s)
        self._stepped = now
        to_ping, lost = [], []
        for session, endpoint in watched.items():
            peer = self._peers.get(session)
            if peer is None:
                peer = self._peers[session] = _Peer(endpoint, heard=now)
            if now - peer.heard > (self.interval_s if session in gone else self.timeout_s):
                lost.append(session)
                del self._peers[session]
            elif now - peer.pinged >= self.interval_s:
                peer.pinged = now
                to_ping.append((session, endpoint))
        return to_ping, lost
