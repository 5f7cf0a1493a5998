"""Decode side: this rank's bootstrap lookups, one client per bootstrap
address, and whether a failed lookup fails rooms at once or is retried
(which addresses answered before, how long one has refused connections).
Used by :class:`~transfer.rooms.links.LinkResolver` on its thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from transfer.errors import BootstrapError, BootstrapRefused, BootstrapUnavailable, KVFerryError, UnknownNodeError
from transfer.rooms.context import LookupClient, RoomContext


def is_final(exc: KVFerryError, reached: bool, refusing_s: float, peer_timeout_s: float) -> bool:
    """Whether a lookup failure fails rooms at once instead of being retried:
    an error reply (an unknown node, after the server's grace time; a refused
    or unauthenticated request), a refused connection to a server this rank
    never reached (a wrong address), or to one it reached before that has
    refused for ``refusing_s`` > ``peer_timeout_s`` (the node is down: a
    restart takes less). A timeout is retried within the room's bootstrap bound."""
    if isinstance(exc, BootstrapRefused):
        return not reached or refusing_s > peer_timeout_s
    return not isinstance(exc, BootstrapUnavailable)


def located(exc: KVFerryError, where: str) -> KVFerryError:
    """``exc`` again, its message prefixed with ``where`` (same type and fields)."""
    if isinstance(exc, UnknownNodeError):
        return UnknownNodeError(f"{where}: {exc}", node_id=exc.node_id, known_nodes=exc.known_nodes)
    if isinstance(exc, BootstrapError):
        return type(exc)(f"{where}: {exc}", code=exc.code)
    return type(exc)(f"{where}: {exc}")


class Lookups:
    """The bootstrap servers this rank looks prefill nodes up at."""

    def __init__(self, ctx: RoomContext) -> None:
        self.ctx = ctx
        self._clients: dict[str, LookupClient] = {}
        self._reached: set[str] = set()  # bootstrap addresses that answered at least once
        self._refusing: dict[str, float] = {}  # reached addresses refusing connections now -> since when

    def lookup(self, addr: str, node: str, dp_rank: int, pace: Callable[[], None] | None = None,
               waiting: Callable[[], AbstractContextManager] | None = None):
        """A strict, partial lookup (an unknown node raises UnknownNodeError;
        a group not complete yet lists the ranks registered so far);
        ``pace()`` between the parts of the reply as it is decoded,
        ``waiting()`` around the wait for the reply (BootstrapClient.request)."""
        try:
            reply = self._client(addr).lookup(node, dp_rank, strict=True, partial=True, pace=pace, waiting=waiting)
        except BootstrapRefused:
            if addr in self._reached:
                self._refusing.setdefault(addr, time.monotonic())
            raise
        self._reached.add(addr)
        self._refusing.pop(addr, None)
        return reply

    def is_final(self, addr: str, exc: KVFerryError) -> bool:
        """Whether ``exc`` of a lookup at ``addr`` fails the rooms (see :func:`is_final`)."""
        since = self._refusing.get(addr)
        return is_final(exc, addr in self._reached, 0.0 if since is None else time.monotonic() - since,
                        self.ctx.config.peer_timeout_s)

    def refusing_since(self, addr: str) -> float | None:
        """Since when ``addr``, which answered before, has refused connections (None: it does not)."""
        return self._refusing.get(addr)

    def _client(self, addr: str) -> LookupClient:
        client = self._clients.get(addr)
        if client is None:
            client = self._clients[addr] = self.ctx.bootstrap_client(addr)
        return client

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
