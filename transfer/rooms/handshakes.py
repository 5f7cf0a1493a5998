"""Decode side: this rank's handshakes with prefill ranks, one per prefill
session: the hello sent, its answer (or refusal), and the counts
``ManagerStats`` reports. Used by :class:`~transfer.rooms.links.LinkResolver`
under ``ctx.lock``, but for :meth:`Handshakes.packed_hello`, which it calls
off the lock."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from transfer.control.base import Packed
from transfer.errors import HandshakeError, IncompatibleLayoutError, IncompatibleTransportError, KVFerryError
from transfer.messages import PeerHello, PeerHelloReply
from transfer.rooms.context import RoomContext
from transfer.stats import FailureReason, tag_reason

log = logging.getLogger("kvferry.receiver")


class Hello:
    """One hello to a prefill session and what came of it."""

    __slots__ = ("sent_at", "ok", "error", "answered_at", "warned")

    def __init__(self) -> None:
        self.sent_at = time.monotonic()
        self.ok = False
        self.error: KVFerryError | None = None
        self.answered_at = 0.0
        self.warned = False  # the slow-handshake warning was logged

    @property
    def wait_s(self) -> float:
        """How long the hello waited (so far) for its answer."""
        return (self.answered_at or time.monotonic()) - self.sent_at

    @property
    def awaited(self) -> bool:
        """Sent, neither answered nor refused."""
        return not self.ok and self.error is None


class Handshakes:
    """The hellos of one decode rank, by prefill session."""

    def __init__(self, ctx: RoomContext) -> None:
        self.ctx = ctx
        self._hellos: dict[str, Hello] = {}
        # answered, refused for a failed open, unanswered (ManagerStats.handshake*)
        self._num_answered = self._num_refused = self._num_unanswered = 0
        self._answer_seconds = 0.0
        # The hello packed, and the generation of this rank's registered memory it was packed
        # at (bumped by announce, under ctx.lock, once the memory changed).
        self._generation = 0
        self._packed: tuple[int, Packed] | None = None

    def hello(self) -> PeerHello:
        """This rank's hello, with its transport's current metadata (NIXL)."""
        exchange = self.ctx.transport.peer_metadata
        return PeerHello(rank=self.ctx.rank, allow_missing_draft=self.ctx.config.allow_missing_draft,
                         transport_meta=exchange.metadata() if exchange is not None else b"")

    def packed_hello(self) -> tuple[int, Packed]:
        """This rank's hello packed, with the generation of its registered
        memory it was packed at: packed once per generation, off
        ``ctx.lock`` (a large model's hello carries hundreds of buffers, up
        to half a millisecond to pack, and NIXL's metadata has its own
        lock). :meth:`start` sends it only if it is still current."""
        packed = self._packed
        if packed is None or packed[0] != self._generation:
            generation = self._generation  # read before the memory it describes
            packed = self._packed = (generation, Packed.of(self.hello()))
        return packed

    def _current(self, packed: tuple[int, Packed] | None) -> Packed:
        """(Under ctx.lock.) ``packed``'s hello if the memory did not change
        since, else the hello packed now."""
        if packed is None or packed[0] != self._generation:
            packed = self.packed_hello()
        return packed[1]

    def get(self, session: str) -> Hello | None:
        return self._hellos.get(session)

    def start(self, session: str, endpoint: str, packed: tuple[int, Packed] | None = None) -> Hello:
        """``session``'s hello, sent now to ``endpoint`` unless one was
        already (``packed``: from :meth:`packed_hello`; None: packed here)."""
        hello = self._hellos.get(session)
        if hello is None:
            hello = self._hellos[session] = Hello()
            self.ctx.channel.send(endpoint, self._current(packed))
        return hello

    def unanswered(self, session: str) -> None:
        """``session`` did not answer in time: forgotten (a new lookup sends a new hello)."""
        del self._hellos[session]
        self._num_unanswered += 1

    def forget(self, session: str, *, unless_answered: bool = False) -> None:
        """Forget ``session``'s hello (``unless_answered``: only one not answered ok: awaited or refused)."""
        hello = self._hellos.get(session)
        if hello is not None and (not unless_answered or not hello.ok):
            del self._hellos[session]

    def on_reply(self, msg: PeerHelloReply) -> bool:
        """A prefill rank answered; True if it settled an awaited hello (one answer per hello counts)."""
        hello = self._hellos.get(msg.session)
        if hello is None or not hello.awaited:
            return False
        hello.ok = msg.ok
        if msg.ok:
            hello.answered_at = time.monotonic()
            self._num_answered += 1
            self._answer_seconds += hello.wait_s
        elif msg.field == "handshake":
            self._num_refused += 1
            hello.error = tag_reason(HandshakeError(f"{self.ctx.where}: prefill rank {msg.session} could not open "
                                                    f"its transport's way to this rank: {msg.reason}",
                                                    peer=msg.session), FailureReason.PEER_LOST)
        else:
            kind = IncompatibleTransportError if msg.field.startswith("transport") else IncompatibleLayoutError
            hello.error = kind(msg.field, "decode side", "prefill side", detail=msg.reason)
        return True

    def counts(self) -> dict[str, float]:
        """This rank's handshakes, in ManagerStats' fields."""
        return {"handshakes": self._num_answered, "handshake_failures": self._num_refused + self._num_unanswered,
                "handshake_timeouts": self._num_unanswered, "handshake_seconds": self._answer_seconds,
                "handshakes_in_progress": sum(1 for h in self._hellos.values() if h.awaited)}

    def announce(self, endpoint_of: Callable[[str], str | None]) -> None:
        """This rank's registered memory changed: send a fresh hello to every
        prefill session a hello went to (``endpoint_of``: its control
        endpoint, None: unknown now), on the socket later grants take, so it
        arrives before any of them."""
        self._generation += 1
        if not self._hellos:
            return
        hello = self._current(None)
        for session in list(self._hellos):
            endpoint = endpoint_of(session)
            if endpoint is None:
                continue
            try:
                self.ctx.channel.send(endpoint, hello)
            except KVFerryError as exc:
                log.warning("%s: new transport metadata not sent to %s: %s", self.ctx.where, endpoint, exc)
