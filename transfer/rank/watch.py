"""A rank's watch over its peers, on the ``kvferry-liveness`` thread: it pings
the peers of live rooms, fails the rooms of a silent one
(:mod:`transfer.liveness` decides who is silent), answers the peers' pings
and takes their pongs (which acknowledge requests:
:mod:`transfer.rooms.request_acks`), and polls the live rooms every
:data:`SWEEP_INTERVAL_S` so that timeouts become state changes (and reach
``KVManager.changed_rooms``) without a scheduler poll.

It is handed the rank's room table, channel, lock and totals; the table
answers ``live_peers``, ``endpoint_of``, ``take_acks``, ``on_pong``,
``peer_lost`` and ``expire`` (see the prefill and decode tables).
"""

from __future__ import annotations

import logging
import threading
import time

from transfer.config import ManagerConfig
from transfer.control.base import ControlChannel, Link
from transfer.errors import KVFerryError
from transfer.liveness import Liveness
from transfer.messages import PeerPing, PeerPong
from transfer.stats import RankTotals

log = logging.getLogger("kvferry.manager")

#: How often the watch polls every live room.
SWEEP_INTERVAL_S = 0.5
#: How often an idle watch (no live room, no peer) looks.
IDLE_TICK_S = 1.0
# Pings whose send time is kept for their pongs (rounds of heartbeat_interval_s / 2).
_PINGS_REMEMBERED = 64


class PeerWatch:
    """``session`` and ``endpoint`` are this rank's (what a ping says)."""

    def __init__(self, config: ManagerConfig, session: str, endpoint: str, *, rooms, channel: ControlChannel,
                 lock: threading.RLock, totals: RankTotals, where: str) -> None:
        self.config, self.session, self.endpoint, self.where = config, session, endpoint, where
        self.rooms, self.channel, self.lock, self.totals = rooms, channel, lock, totals
        self.liveness = Liveness(config.heartbeat_interval_s, config.peer_timeout_s)
        # how long a connection stays UP after its peer stopped answering (transfer.control.base)
        self._link_lag_s = config.peer_timeout_s / 2
        self._seq = 0
        self._pinged_at: dict[int, float] = {}  # ping seq -> when it was sent (the latest few)
        self._next_sweep = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvferry-liveness", daemon=True)

    @property
    def num_watched(self) -> int:
        """Peers under watch now."""
        with self.lock:
            return self.liveness.num_watched

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.config.rpc_timeout_s + 1)

    # --- the control thread: a peer's ping or pong ---------------------------------

    def on_ping(self, msg: PeerPing) -> None:
        """Answer known peers only, at the endpoint this rank knows them by:
        a ping cannot make it connect anywhere else."""
        with self.lock:
            endpoint = self.rooms.endpoint_of(msg.session)
            self.liveness.heard(msg.session, time.monotonic())
            acks = self.rooms.take_acks(msg.session) if endpoint is not None else ()
        if endpoint is not None:
            try:
                self.channel.send(endpoint, PeerPong(session=self.session, seq=msg.seq, acks=acks))
            except KVFerryError as exc:  # closing, or the peer's queue is full
                log.debug("%s: pong to %s not sent: %s", self.where, endpoint, exc)

    def on_pong(self, msg: PeerPong) -> None:
        with self.lock:
            self.liveness.heard(msg.session, time.monotonic())
            pinged_at = self._pinged_at.get(msg.seq)
        self.rooms.on_pong(msg.session, msg.acks, pinged_at)

    # --- the watch thread ------------------------------------------------------------

    def _run(self) -> None:
        tick = self.config.heartbeat_interval_s / 2
        while not self._stop.wait(tick):
            try:
                busy = self._round(time.monotonic())
            except Exception:  # the watch must outlive any one round
                log.exception("%s: liveness round failed", self.where)
                busy = True
            # Nothing watched and no live room: look again in a while (a new room is watched from
            # its first round on, within IDLE_TICK_S; its liveness bound counts from there).
            tick = self.config.heartbeat_interval_s / 2 if busy else max(self.config.heartbeat_interval_s / 2,
                                                                          IDLE_TICK_S)

    def _round(self, now: float) -> bool:
        """One round; whether anything is watched or live."""
        times = self.totals.round_times
        with times.round("liveness"):
            watched, live = self._heartbeats(now)
        if now >= self._next_sweep:  # timeouts fire here, not only when a scheduler polls
            self._next_sweep = now + SWEEP_INTERVAL_S
            with times.round("sweep") as sweep:  # thousands of rooms: given up every SLICE_CPU_S
                self.rooms.expire(sweep.tick)
        return bool(watched or live)

    def _heartbeats(self, now: float) -> tuple[dict, int]:
        """Ping the watched peers, give up the lost ones; returns (watched, live rooms)."""
        with self.lock:
            watched = self.rooms.live_peers(now)
            live = self.rooms.num_live
            gone = set()
            for session, endpoint in watched.items():
                # Alive as the connection says (its heartbeats are answered by the peer's libzmq,
                # not by its Python threads): a busy or starved process is not taken for dead;
                # a killed one is found once its address refuses a reconnection.
                link = self.channel.link(endpoint)
                if link is Link.UP:
                    # UP vouches for the peer only up to the connection's heartbeat bound (a stopped
                    # process's connection stays UP for peer_timeout_s / 2): credited as heard then,
                    # so a stopped peer is lost peer_timeout_s after it stopped, not half as long again.
                    self.liveness.heard(session, now - self._link_lag_s)
                elif link is Link.GONE:
                    gone.add(session)
            to_ping, lost = self.liveness.step(watched, now, gone)
            paused = self.liveness.last_pause_s
            self.totals.num_peers_lost += len(lost)
            self._seq += 1
            seq = self._seq
            # Taken before the pings go out: a request sent before ``now`` went before this ping.
            self._pinged_at[seq] = now
            self._pinged_at.pop(seq - _PINGS_REMEMBERED, None)
        if paused >= self.config.peer_timeout_s / 2 and watched:
            log.warning("%s: this rank's watch did not run for %.1f s (its process stopped or starved, or its host "
                        "paused): not counted as silence of its %d watched peers", self.where,
                        paused + self.config.heartbeat_interval_s, len(watched))
        ping = PeerPing(session=self.session, endpoint=self.endpoint, seq=seq)
        for _, endpoint in to_ping:
            try:
                self.channel.send(endpoint, ping)
            except KVFerryError as exc:
                log.debug("%s: ping to %s not sent: %s", self.where, endpoint, exc)
        if lost:  # what a lost peer said before it went counts first (queued behind a busy scheduler, say)
            self.channel.settle(self.config.rpc_timeout_s)
        for session in lost:
            why = "gone: its control endpoint refuses connections (the process exited or was killed)" \
                if session in gone else \
                f"silent for more than {self.config.peer_timeout_s:g} s: dead, stopped or unreachable"
            log.warning("%s: peer %s %s: failing its rooms", self.where, session, why)
            # Its socket stays: what its rooms' failure sends it (their aborts) reaches it if it
            # was only stopped and comes back.
            self.rooms.peer_lost(session, why, gone=session in gone)
        return watched, live
