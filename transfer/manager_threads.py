"""The KVManager's background work: registering with the bootstrap server
(at start, every ``register_interval_s``, and off at close) and the liveness
watcher (peer pings, silent peers, timeout sweeps). A base class of
:class:`transfer.manager.KVManager` (the same object's state)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from transfer.errors import BootstrapError, BootstrapUnavailable, KVFerryError
from transfer.messages import PeerPing

if TYPE_CHECKING:
    from bootstrap.client import BootstrapClient

log = logging.getLogger("kvferry.manager")

# Once every DP group of its node answered ready, a prefill rank looks its
# node's sessions up again every this many re-registrations (a sibling that
# restarted has a new session); until then at every one.
_LEARN_EVERY = 10

# Pings whose send time is kept for their pongs (rounds of heartbeat_interval_s / 2).
_PINGS_REMEMBERED = 64

#: How often the liveness thread polls every live room, so that timeouts
#: become state changes (and reach ``changed_rooms``) without a scheduler poll.
_SWEEP_INTERVAL_S = 0.5


class ManagerThreads:
    """Bootstrap registration and the liveness watcher of a :class:`KVManager`."""

    def _register(self) -> None:
        deadline = time.monotonic() + self.config.register_timeout_s
        client = self.bootstrap_client(self.config.bootstrap_addr)
        try:
            while True:
                try:
                    reply = client.register(self.rank)
                    log.info("%s registered (%d of %d ranks)", self.where, reply.num_registered, reply.tp_size)
                    return
                except BootstrapUnavailable:
                    if time.monotonic() >= deadline:
                        raise BootstrapUnavailable(
                            f"{self.where}: bootstrap server {self.config.bootstrap_addr} unreachable for "
                            f"{self.config.register_timeout_s:g} s") from None
                    time.sleep(0.2)
                except BootstrapError as exc:
                    raise BootstrapError(f"{self.where}: registration refused: {exc}", code=exc.code) from exc
        finally:
            client.close()

    def _keep_registered(self) -> None:
        """Re-register every ``register_interval_s``, and learn the sessions
        of this node's other prefill ranks (which no decode peer may
        declare); log when the server is lost and found again. Never raises."""
        client = self.bootstrap_client(self.config.bootstrap_addr)
        reachable = True
        try:
            learned, n = self._learn_prefill_sessions(client), 0
            while not self._stop.wait(self.config.register_interval_s):
                try:
                    client.register(self.rank)
                    n += 1
                    if not learned or n % _LEARN_EVERY == 0:
                        learned = self._learn_prefill_sessions(client)
                except KVFerryError as exc:
                    if reachable:
                        log.warning("%s: re-registration failed (will keep trying): %s", self.where, exc)
                    reachable = False
                    continue
                if not reachable:
                    log.warning("%s: registered again with bootstrap server %s", self.where,
                                self.config.bootstrap_addr)
                reachable = True
        finally:
            client.close()

    def _learn_prefill_sessions(self, client: BootstrapClient) -> bool:
        """Add the transfer sessions of this node's ranks, every DP group, to
        those no decode peer may declare (the set only grows within a
        process's life); True when every group answered ready."""
        sessions, complete = {self.rank.session}, True
        for dp in range(self.config.dp_size):
            try:
                reply = client.lookup(self.config.node_id, dp)
            except KVFerryError as exc:
                log.debug("%s: looking up this node's ranks: %s", self.where, exc)
                complete = False
                continue
            complete = complete and reply.ready
            sessions.update(r.session for r in reply.ranks)
        with self._lock:
            self.rooms.prefill_sessions = self.rooms.prefill_sessions | sessions
        return complete

    def _unregister(self) -> None:
        """Drop this rank's bootstrap entry now (errors ignored: the server's
        rank TTL drops it anyway)."""
        client = self.bootstrap_client(self.config.bootstrap_addr)
        try:
            client.unregister(self.rank, timeout_s=0.5)
        except KVFerryError as exc:
            log.info("%s: not unregistered (its entry expires at the server's rank TTL): %s", self.where, exc)
        finally:
            client.close()

    def _watch(self) -> None:
        """Ping the peers of live rooms; fail the rooms of silent ones."""
        tick = self.config.heartbeat_interval_s / 2
        while not self._stop.wait(tick):
            try:
                now = time.monotonic()
                with self._lock:
                    watched = self.rooms.live_peers(now)
                    to_ping, lost = self.liveness.step(watched, now)
                    self._totals.num_peers_lost += len(lost)
                    self._ping_seq += 1
                    seq = self._ping_seq
                    # Taken before the pings go out: a request sent before ``now`` went before this ping.
                    self._pinged_at[seq] = now
                    self._pinged_at.pop(seq - _PINGS_REMEMBERED, None)
                ping = PeerPing(session=self.rank.session, endpoint=self.rank.control_endpoint, seq=seq)
                for _, endpoint in to_ping:
                    try:
                        self.channel.send(endpoint, ping)
                    except KVFerryError as exc:
                        log.debug("%s: ping to %s not sent: %s", self.where, endpoint, exc)
                for session in lost:
                    log.warning("%s: peer %s silent for more than %g s: failing its rooms", self.where, session,
                                self.config.peer_timeout_s)
                    self.rooms.peer_lost(session, self.config.peer_timeout_s)
                    self.channel.forget(watched[session])
                if now >= self._next_sweep:  # timeouts fire here, not only when a scheduler polls
                    self._next_sweep = now + _SWEEP_INTERVAL_S
                    self.rooms.expire()
            except Exception:  # the watcher must outlive any one round
                log.exception("%s: liveness round failed", self.where)
