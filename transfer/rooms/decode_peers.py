"""Prefill side: the decode ranks this rank answered the handshake of (its
peers), who may be one (:mod:`transfer.rooms.peer_check`), and the hello's
answer once the transport opened its way to the peer
(:mod:`transfer.transport.opener`). Used by
:class:`~transfer.rooms.prefill_table.PrefillRooms`: only a peer's requests
reach a room, and a room's writes go only to peers."""

from __future__ import annotations

import collections
import logging

from bootstrap.messages import RankInfo
from transfer.errors import IncompatibleLayoutError, KVFerryError
from transfer.layout import check_compatible
from transfer.messages import PeerHello, PeerHelloReply
from transfer.rooms.context import RoomContext
from transfer.rooms.peer_check import identity_problem

log = logging.getLogger("kvferry.sender")

#: decode sessions refused for their layout kept (their aborts may still end rooms)
_INCOMPATIBLE_KEPT = 4096


class DecodePeers:
    def __init__(self, ctx: RoomContext) -> None:
        self.ctx = ctx
        self.peers: dict[str, RankInfo] = {}  # decode session -> its rank info
        self._origins: dict[str, str] = {}  # decode session -> where its hello came from
        # Decode sessions whose hello was refused for an incompatible layout
        # (-> origin): their aborts may still end rooms that await them, so
        # that prefill learns why the decode side gave up.
        self._incompatible: collections.OrderedDict[str, str] = collections.OrderedDict()
        #: transfer sessions of this node's prefill ranks (from the bootstrap
        #: server; set by the manager), which no decode peer may declare
        self.prefill_sessions: frozenset[str] = frozenset()
        #: hellos refused for the identity they declared (peer_check)
        self.num_refused_hellos = 0

    def is_peer(self, session: str, origin: str, endpoint: str | None = None) -> bool:
        """Whether ``session`` handshook (at ``endpoint``, when given), and
        ``origin`` is where its handshake came from (unless either is unknown
        or ``check_peer_host`` is off)."""
        peer = self.peers.get(session)
        if peer is None or (endpoint is not None and peer.control_endpoint != endpoint):
            return False
        return self._same_origin(origin, self._origins.get(session, ""))

    def is_incompatible(self, session: str, origin: str) -> bool:
        """Whether ``session``'s hello (from ``origin``) was refused for its layout."""
        seen = self._incompatible.get(session)
        return seen is not None and self._same_origin(origin, seen)

    def _same_origin(self, origin: str, seen: str) -> bool:
        """Whether a message from ``origin`` may be the session's whose hello came from ``seen``
        (either unknown, or ``check_peer_host`` off: yes)."""
        return not (self.ctx.config.check_peer_host and origin and seen and origin != seen)

    def endpoint_of(self, session: str) -> str | None:
        """The control endpoint of a handshaken decode rank."""
        peer = self.peers.get(session)
        return peer.control_endpoint if peer is not None else None

    def on_hello(self, hello: PeerHello, origin: str) -> None:
        """A decode rank's hello (not under the lock): refused for its
        identity or its layout at once, else answered once the transport
        opened its way to the peer."""
        session = hello.rank.session
        with self.ctx.lock:
            problem = identity_problem(session, origin, own_session=self.ctx.rank.session,
                                       prefill_sessions=self.prefill_sessions,
                                       check_host=self.ctx.config.check_peer_host)
            if problem:
                self.num_refused_hellos += 1
        if problem:
            log.error("%s: refused a decode peer (hello from %s, endpoint %s): it %s", self.ctx.where,
                      origin or "?", hello.rank.control_endpoint, problem)
            reply = PeerHelloReply(session=self.ctx.rank.session, ok=False, field="session",
                                   reason=f"{self.ctx.where}: refused a decode peer that {problem}")
            self.ctx.channel.send(hello.rank.control_endpoint, reply)
            return
        try:
            check_compatible(self.ctx.rank, hello.rank, local_is_prefill=True,
                             allow_missing_draft=hello.allow_missing_draft)
        except IncompatibleLayoutError as exc:
            log.error("%s: refused decode rank %s: %s", self.ctx.where, session, exc)
            with self.ctx.lock:
                self._incompatible[session] = origin
                while len(self._incompatible) > _INCOMPATIBLE_KEPT:
                    self._incompatible.popitem(last=False)
            reply = PeerHelloReply(session=self.ctx.rank.session, ok=False, field=exc.field,
                                   reason=f"{self.ctx.where}: {exc}")
        else:
            reply = self._open_peer(hello, origin)
            if reply is None:
                return  # answered once the transport opened the way to the peer
        self.ctx.channel.send(hello.rank.control_endpoint, reply)

    def _open_peer(self, hello: PeerHello, origin: str) -> PeerHelloReply | None:
        """Have the transport open its way to the decode peer (its segment,
        a probe write: :mod:`transfer.transport.opener`, off this thread) and
        answer the hello once it is open, or could not be (``field``
        ``handshake``: decode's rooms through this rank fail with a
        HandshakeError). Returns the refusal of a hello whose transport
        metadata this side cannot use, else None."""
        session, endpoint = hello.rank.session, hello.rank.control_endpoint

        def opened(error) -> None:
            if error is None:
                with self.ctx.lock:
                    self.peers[session] = hello.rank
                    self._origins[session] = origin
                reply = PeerHelloReply(session=self.ctx.rank.session, ok=True, field="", reason="")
            else:
                log.error("%s: could not open the way to decode rank %s: %s", self.ctx.where, session, error)
                reply = PeerHelloReply(session=self.ctx.rank.session, ok=False, field="handshake",
                                       reason=f"{self.ctx.where}: {error}")
            try:
                self.ctx.channel.send(endpoint, reply)
            except KVFerryError as exc:
                log.warning("%s: the handshake reply to %s was not sent: %s", self.ctx.where, endpoint, exc)

        try:
            self.ctx.transport.open_peer(session, hello.transport_meta, opened)
        except KVFerryError as exc:
            log.error("%s: refused decode rank %s: %s", self.ctx.where, session, exc)
            field = exc.field if isinstance(exc, IncompatibleLayoutError) else "transport"
            return PeerHelloReply(session=self.ctx.rank.session, ok=False, field=field,
                                  reason=f"{self.ctx.where}: {exc}")
        return None
