"""Decode side: the rank's links to prefill nodes. A :class:`Link` is one
prefill DP group (its ranks, and what each sends for a room: planned by
:mod:`transfer.rooms.routes`); the :class:`LinkResolver` finds them
(bootstrap lookup, then a handshake with each prefill rank, kept by
:mod:`transfer.rooms.handshakes`) on a background thread."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from bootstrap.messages import RankInfo
from transfer.errors import (BootstrapError, BootstrapUnavailable, IncompatibleLayoutError, KVFerryError, PeerError,
                             ProtocolError)
from transfer.layout import check_compatible
from transfer.messages import PeerHelloReply, PoolAssignment
from transfer.rooms.context import RoomContext
from transfer.rooms.handshakes import Handshakes
from transfer.rooms.lookups import Lookups, located
from transfer.rooms.routes import plan_routes
from transfer.stats import FailureReason, tag_reason

log = logging.getLogger("kvferry.receiver")

# Pause between bootstrap lookups while a prefill node is not ready yet.
_RETRY_S = 0.02
# With nothing to resolve, the resolver looks at its links this often (it is woken when a room needs one).
_IDLE_S = 1.0
# How long a refused lookup fails new rooms before one is tried again.
_REFUSAL_S = 1.0
#: A handshake not answered after this long is logged as a warning (once per hello).
SLOW_HANDSHAKE_S = 1.0
# A ready link used within this long is kept under liveness watch even with
# no live room, so a prefill rank that died while idle is noticed (and its
# link forgotten) before the next room needs it.
_WATCH_IDLE_LINKS_S = 60.0
# The CPU each part of a new peer's control socket (the socket, its monitor, its connect) takes
# (0.02-0.13 ms quiet; the three together 0.15-0.45 ms, up to 1.08 ms on a loaded host): the
# resolver gives each a slice of its own (RoundTimes' tick(ahead_s)).
_OPEN_CPU_S = 0.0004


class LinkState(enum.Enum):
    RESOLVING = "resolving"
    READY = "ready"
    FAILED = "failed"

    __hash__ = object.__hash__  # singletons: hashed by identity, in C


class Link:
    """One prefill DP group as this decode rank sees it: its ranks, and what
    each contacted rank sends for a room (the same for every room)."""

    def __init__(self, key: tuple[str, str, int]) -> None:
        self.key = key
        self.state = LinkState.RESOLVING
        self.error: KVFerryError | None = None
        self.progress = "lookup not answered yet"
        self.ranks: dict[int, RankInfo] = {}  # TP rank -> what the server lists (maybe not every rank)
        self.routes: dict[int, tuple[PoolAssignment, ...]] = {}
        self.num_requests: dict[int, int] = {}
        self.aux_rank = -1
        self.state_ranks: tuple[tuple[int, ...], ...] = ()  # per state pool: the prefill TP ranks that send it here
        self.last_wanted = time.monotonic()
        self.created_at = time.monotonic()
        self.introduced: set[str] = set()  # sessions this rank's hello went to after a refused layout
        #: when this link began waiting for its prefill ranks' handshake answers (0: it has not), and when
        #: it was ready (0: not yet): the wait the rooms created meanwhile report (RoomStats.handshake_wait_s)
        self.handshake_since = 0.0
        self.ready_at = 0.0

    def handshake_wait(self, since: float, now: float) -> float:
        """How long of ``[since, now]`` this link waited on its handshakes."""
        if not self.handshake_since:
            return 0.0
        return max(0.0, min(self.ready_at or now, now) - max(self.handshake_since, since))

    @property
    def name(self) -> str:
        addr, node, dp = self.key
        return f"prefill node {node!r} dp {dp} (bootstrap {addr})"


class LinkResolver:
    """Resolves prefill nodes for one decode rank on the ``kvferry-resolver``
    thread. Receivers ask for links under ``ctx.lock`` (:meth:`link`); a
    failed link is forgotten, so the next room tries afresh: no peer is
    blacklisted for good. After each round in which something was being
    resolved it calls ``kick(pace)`` (waiting receivers advance at once,
    ``pace()`` between two), and
    after every round ``tick()`` (housekeeping of the owner, which returns
    the seconds until it wants another, or None), both without the lock.
    Idle, the thread sleeps: it wakes when a room asks for a link it does
    not have, or when its owner's housekeeping is due."""

    def __init__(self, ctx: RoomContext, kick: Callable[[Callable[[], None]], None],
                 tick: Callable[[], float | None]) -> None:
        self.ctx = ctx
        self._kick, self._tick = kick, tick
        self.links: dict[tuple[str, str, int], Link] = {}
        self.dp_sizes: dict[tuple[str, str], int] = {}  # 0: being looked up
        self._dp_wanted: dict[tuple[str, str], float] = {}
        # A lookup refused for good (authentication, a conflict): rooms asking
        # for the node within _REFUSAL_S fail with it; later ones try afresh.
        self._dp_refused: dict[tuple[str, str], tuple[float, KVFerryError]] = {}
        self.handshakes = Handshakes(ctx)
        self._lookups = Lookups(ctx)
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvferry-resolver", daemon=True)
        self._thread.start()

    # --- used under ctx.lock ----------------------------------------------------------

    def link(self, addr: str, node: str, dp_rank: int | None, room: int) -> Link | None:
        """The link for a room; None while the node's DP size is unknown."""
        now = time.monotonic()
        if dp_rank is None:
            refused = self._dp_refused.get((addr, node))
            if refused is not None and now - refused[0] < _REFUSAL_S:
                link = Link((addr, node, -1))
                link.state, link.error = LinkState.FAILED, refused[1]
                return link
            dp_size = self.dp_sizes.get((addr, node))
            if dp_size is None:
                self.dp_sizes[(addr, node)] = 0
                self._wake.set()
            if not dp_size:
                self._dp_wanted[(addr, node)] = now
                return None
            dp_rank = room % dp_size
        key = (addr, node, dp_rank)
        link = self.links.get(key)
        if link is None:
            link = self.links[key] = Link(key)
            self._wake.set()
        link.last_wanted = now
        return link

    def endpoint_of(self, session: str) -> str | None:
        """The control endpoint of a prefill rank of a known link."""
        for link in self.links.values():
            for r in link.ranks.values():
                if r.session == session:
                    return r.control_endpoint
        return None

    def watched(self, now: float) -> dict[str, str]:
        """Session -> control endpoint of the sending ranks of ready links
        used within ``_WATCH_IDLE_LINKS_S``, and of the prefill ranks whose
        answer to this rank's hello is awaited (one that died meanwhile
        must fail its link's rooms, not leave them to the bootstrap bound)."""
        peers = {}
        for link in self.links.values():
            if link.state is LinkState.READY and now - link.last_wanted < _WATCH_IDLE_LINKS_S:
                for p in link.routes:
                    peers[link.ranks[p].session] = link.ranks[p].control_endpoint
            elif link.state is LinkState.RESOLVING:
                for p in link.routes:
                    hello = self.handshakes.get(link.ranks[p].session)
                    if hello is not None and hello.awaited:
                        peers[link.ranks[p].session] = link.ranks[p].control_endpoint
        return peers

    def forget_session(self, session: str, why: str = "") -> None:
        """A prefill rank went silent or is gone (``why``; empty: it said
        goodbye): forget every ready link through it (the next room looks
        the node up afresh); a link still waiting for its handshake fails,
        with its rooms."""
        for link in [l for l in self.links.values() if any(r.session == session for r in l.ranks.values())]:
            if why and link.state is LinkState.RESOLVING:
                p = next(p for p, r in link.ranks.items() if r.session == session)
                link.state, link.error = LinkState.FAILED, tag_reason(PeerError(
                    f"{self.ctx.where}: prefill rank {p} of {link.name} ({session}) {why}, before it answered "
                    "this rank's handshake"), FailureReason.PEER_LOST)
            else:
                self.forget(link)
        self.handshakes.forget(session)

    def forget(self, link: Link) -> None:
        if self.links.get(link.key) is link:
            del self.links[link.key]
        for r in link.ranks.values():
            self.handshakes.forget(r.session, unless_answered=True)

    def on_hello_reply(self, msg: PeerHelloReply) -> None:
        if self.handshakes.on_reply(msg):
            self._wake.set()

    def handshake_counts(self) -> dict[str, float]:
        """This rank's handshakes, in ManagerStats' fields (under ctx.lock)."""
        return self.handshakes.counts()

    def announce(self) -> None:
        """This rank's registered memory changed (called under ctx.lock): a
        fresh hello to every prefill rank a hello went to."""
        self.handshakes.announce(self.endpoint_of)

    # --- resolver thread --------------------------------------------------------------

    def _run(self) -> None:
        wait = _IDLE_S
        while not self._closed:
            self._wake.wait(wait)
            self._wake.clear()
            with self.ctx.stats.round_times.round("resolver") as round_:
                wait = self._round(round_.tick, round_.waiting)

    def _round(self, pace: Callable[..., None], waiting: Callable[[], AbstractContextManager]) -> float:
        """One round: DP sizes and links to resolve, then the owner's due
        work; returns how long to wait for the next. ``pace()`` between two
        lookups or links gives the interpreter lock up once the round ran
        SLICE_CPU_S (a new node's first lookup decodes every rank's
        descriptors), ``pace(ahead_s)`` before a part known to take
        ``ahead_s``; ``waiting()`` around a lookup's wait for its reply (the
        lock is released there: the holds on either side are measured apart)."""
        with self.ctx.lock:
            self._expire(time.monotonic() - self.ctx.config.bootstrap_timeout_s)
            dp_todo = [k for k, v in self.dp_sizes.items() if v == 0]
            todo = [l for l in self.links.values() if l.state is LinkState.RESOLVING]
        for addr, node in dp_todo:
            pace()
            try:
                reply = self._lookups.lookup(addr, node, 0, pace, waiting)
            except (BootstrapUnavailable, ProtocolError, BootstrapError) as exc:
                if not self._lookups.is_final(addr, exc):
                    log.debug("dp size of %s at %s: %s", node, addr, exc)
                    continue
                with self.ctx.lock:  # refused: retrying will not help
                    self.dp_sizes.pop((addr, node), None)
                    self._dp_refused[(addr, node)] = (time.monotonic(), located(
                        exc, f"{self.ctx.where}: looking up prefill node {node!r} at {addr}"))
                continue
            if reply.dp_size:
                with self.ctx.lock:
                    self.dp_sizes[(addr, node)] = reply.dp_size
        for link in todo:
            pace()
            try:
                self._step(link, pace, waiting)
            except KVFerryError as exc:
                with self.ctx.lock:
                    link.state, link.error = LinkState.FAILED, exc
            except Exception as exc:  # the resolver must outlive any one link
                log.exception("resolving %s", link.name)
                with self.ctx.lock:
                    link.state = LinkState.FAILED
                    link.error = ProtocolError(f"{link.name}: {type(exc).__name__}: {exc}")
        if dp_todo or todo:
            self._kick(pace)
        pace()
        due = self._tick()
        # Idle, it sleeps until woken (a room wants a link) or its owner's next due work.
        resolving = dp_todo or any(l.state is LinkState.RESOLVING for l in todo)
        return _RETRY_S if resolving else min(_IDLE_S, _IDLE_S if due is None else max(due, _RETRY_S))

    def _expire(self, horizon: float) -> None:
        """Stop resolving what no receiver asked for since ``horizon``."""
        for key in [k for k, v in self.dp_sizes.items() if v == 0 and self._dp_wanted.get(k, 0) < horizon]:
            del self.dp_sizes[key]
            self._dp_wanted.pop(key, None)
        for link in [l for l in self.links.values()
                     if l.state is not LinkState.READY and l.last_wanted < horizon]:
            self.forget(link)

    def _step(self, link: Link, pace: Callable[..., None], waiting: Callable[[], AbstractContextManager]) -> None:
        addr, node, dp = link.key
        if not link.routes:
            try:
                reply = self._lookups.lookup(addr, node, dp, pace, waiting)
            except BootstrapUnavailable as exc:
                if self._lookups.is_final(addr, exc):
                    since = self._lookups.refusing_since(addr)
                    down = (f" (it answered before, and has refused connections for "
                            f"{time.monotonic() - since:.1f} s: the prefill node is down)") if since else ""
                    raise located(exc, f"{self.ctx.where}: looking up {link.name}{down}") from exc
                link.progress = str(exc)
                return
            except BootstrapError as exc:
                raise located(exc, f"{self.ctx.where}: looking up {link.name}") from exc
            if not reply.ranks:
                link.progress = f"{reply.num_registered} of {reply.tp_size or '?'} prefill ranks registered"
                return
            pace()
            # The ranks this rank's routes name are enough: the others may not
            # be up yet, or may have left while this group serves other decode ranks.
            if not self._route(link, {r.tp_rank: r for r in reply.ranks}, reply.tp_size, pace):
                return
            missing = sorted(link.routes.keys() - link.ranks.keys())
            if missing:
                link.routes = {}
                gone = [p for p in missing if p in reply.departed]
                if gone:
                    raise tag_reason(PeerError(
                        f"{self.ctx.where}: prefill ranks {gone} of {link.name} left (unregistered, or silent past "
                        "the bootstrap server's rank TTL) and did not register again; this rank's rooms need "
                        "them"), FailureReason.PEER_LOST)
                link.progress = (f"waiting for prefill ranks {missing} to register ({reply.num_registered} of "
                                 f"{reply.tp_size} registered)")
                return
        # The hellos one rank at a time, each paced: the hello packed and each new peer's
        # socket opened off the rank's lock (the first round: a few hundred microseconds each).
        pace()
        packed = self.handshakes.packed_hello()
        for p in link.routes:
            pace(_OPEN_CPU_S)  # each part a slice of its own
            self.ctx.channel.connect(link.ranks[p].control_endpoint, between=lambda: pace(_OPEN_CPU_S))
            pace()
            with self.ctx.lock:
                self.handshakes.start(link.ranks[p].session, link.ranks[p].control_endpoint, packed)
        pace()
        with self.ctx.lock:
            pending = []
            for p in link.routes:
                session = link.ranks[p].session
                hello = self.handshakes.start(session, link.ranks[p].control_endpoint)
                if hello.error is not None:
                    raise hello.error
                if not hello.ok:
                    if not hello.warned and hello.wait_s > SLOW_HANDSHAKE_S:
                        hello.warned = True
                        log.warning("%s: prefill rank %d of %s (session %s) has not answered this rank's handshake "
                                    "for %.1f s: it is opening its transport's way to this rank (at most its "
                                    "EngineConfig.handshake_timeout_s)", self.ctx.where, p, link.name, session,
                                    hello.wait_s)
                    if time.monotonic() - hello.sent_at > self.ctx.config.rpc_timeout_s:
                        # A dead rank the server still lists, or one restarting: look the node up
                        # again (its rooms fail at their bootstrap timeout if it never answers).
                        self.handshakes.unanswered(session)
                        link.progress = (f"prefill rank {p} at {link.ranks[p].control_endpoint} did not answer "
                                         f"the handshake within {self.ctx.config.rpc_timeout_s:g} s; looking it up again")
                        link.ranks, link.routes = {}, {}
                        return
                    pending.append(p)
            if pending:
                now = time.monotonic()
                link.handshake_since = link.handshake_since or min(self.handshakes.get(link.ranks[p].session).sent_at
                                                                   for p in pending)
                link.progress = (f"waiting for the handshake of prefill ranks {pending} for "
                                 f"{now - link.handshake_since:.1f} s (they answer once their transport opened "
                                 "its way to this rank)")
            else:
                link.state, link.ready_at = LinkState.READY, time.monotonic()

    def _route(self, link: Link, ranks: dict[int, RankInfo], prefill_tp: int, pace: Callable[[], None]) -> bool:
        """The routes of this rank's rooms to the group of ``prefill_tp``
        ranks, of which ``ranks`` (TP rank -> info) registered so far. False:
        the layouts are incompatible and some of the group's ranks have not
        registered yet; the link waits for them (within
        ``bootstrap_timeout_s``), so that the refusal reaches every rank.
        ``pace()`` between two ranks' checks."""
        local = self.ctx.rank
        link.ranks = ranks  # known before the check, so a failure can reach every rank
        hello = self.handshakes.packed_hello()[1]
        for r in ranks.values():
            pace()
            try:
                check_compatible(local, r, local_is_prefill=False,
                                 allow_missing_draft=self.ctx.config.allow_missing_draft)
            except IncompatibleLayoutError as exc:
                # Introduce this rank anyway: prefill finds the same field, and
                # then takes this rank's abort of the rooms that await it.
                for q in ranks.values():
                    if q.session in link.introduced:
                        continue
                    link.introduced.add(q.session)
                    try:
                        self.ctx.channel.send(q.control_endpoint, hello)
                    except KVFerryError as send_exc:
                        log.debug("hello to %s not sent: %s", q.control_endpoint, send_exc)
                unknown = sorted(set(range(prefill_tp)) - ranks.keys())
                if unknown and time.monotonic() - link.created_at < self.ctx.config.bootstrap_timeout_s:
                    # A rank not registered yet would wait for this rank's requests until its own
                    # bootstrap timeout: the refusal (and the rooms' aborts) must reach it too.
                    link.ranks, link.routes = {}, {}
                    link.progress = f"{exc}; waiting for prefill ranks {unknown} to register, to tell them too"
                    return False
                raise
        routes = plan_routes(local, next(iter(ranks.values())).pools, prefill_tp)  # every rank: the same pools
        link.routes, link.num_requests = routes.assignments, routes.num_requests
        link.aux_rank, link.state_ranks = routes.aux_rank, routes.state_ranks
        return True

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(2.0)
        self._lookups.close()
