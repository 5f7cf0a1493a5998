"""A prefill rank's entry at the bootstrap server: registered at start, kept
fresh on its own thread, removed at close.

- :meth:`Registration.register` (at start, blocking): retries for
  ``register_timeout_s`` while the server does not answer, then raises
  :class:`~transfer.errors.BootstrapUnavailable`; a refusal raises at once.
- :meth:`Registration.start` starts ``kvferry-register``, which registers
  again every ``register_interval_s`` (a restarted server is re-populated; a
  dead rank drops out at the server's rank TTL) and learns the transfer
  sessions of its node's other prefill ranks, which no decode peer may
  declare (handed to ``on_sessions``). It never raises; it logs when the
  server is lost and found again.
- :meth:`Registration.close` stops the thread and unregisters (errors are
  ignored: the entry then expires at the server's rank TTL).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING
from collections.abc import Callable
from contextlib import AbstractContextManager

from bootstrap.messages import RankInfo
from transfer.config import ManagerConfig
from transfer.errors import BootstrapError, BootstrapUnavailable, KVFerryError
from transfer.round_times import RoundTimes

if TYPE_CHECKING:
    from bootstrap.client import BootstrapClient

log = logging.getLogger("kvferry.manager")

# Once every DP group of its node answered ready, a prefill rank looks its
# node's sessions up again every this many re-registrations (a sibling that
# restarted has a new session); until then at every one.
LEARN_EVERY = 10


class Registration:
    """``client(addr)`` opens a bootstrap client (the caller's factory);
    ``on_sessions(sessions)`` gets the node's prefill sessions, a set that
    only grows, on the registration thread; each re-registration is a
    ``register`` round of ``round_times``."""

    def __init__(self, config: ManagerConfig, rank: RankInfo, client: Callable[[str], BootstrapClient],
                 on_sessions: Callable[[frozenset[str]], None], where: str, round_times: RoundTimes) -> None:
        self.config, self.rank, self.where, self.round_times = config, rank, where, round_times
        self._client, self._on_sessions = client, on_sessions
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered = False

    def register(self) -> None:
        config = self.config
        deadline = time.monotonic() + config.register_timeout_s
        client = self._client(config.bootstrap_addr)
        try:
            while True:
                try:
                    reply = client.register(self.rank)
                    log.info("%s registered (%d of %d ranks)", self.where, reply.num_registered, reply.tp_size)
                    self.registered = True
                    return
                except BootstrapUnavailable:
                    if time.monotonic() >= deadline:
                        raise BootstrapUnavailable(
                            f"{self.where}: bootstrap server {config.bootstrap_addr} unreachable for "
                            f"{config.register_timeout_s:g} s") from None
                    time.sleep(0.2)
                except BootstrapError as exc:
                    raise BootstrapError(f"{self.where}: registration refused: {exc}", code=exc.code) from exc
        finally:
            client.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._keep, name="kvferry-register", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop re-registering and leave the server at once (not at its rank TTL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.config.rpc_timeout_s + 1)
        if not self.registered:
            return
        self.registered = False
        client = self._client(self.config.bootstrap_addr)
        try:
            client.unregister(self.rank, timeout_s=0.5)
        except KVFerryError as exc:
            log.info("%s: not unregistered (its entry expires at the server's rank TTL): %s", self.where, exc)
        finally:
            client.close()

    def _keep(self) -> None:
        client = self._client(self.config.bootstrap_addr)
        reachable = True
        try:
            learned, n = self._learn(client), 0
            while not self._stop.wait(self.config.register_interval_s):
                with self.round_times.round("register") as round_:
                    try:
                        client.register(self.rank, waiting=round_.waiting)  # the reply's wait is no hold
                        n += 1
                        if not learned or n % LEARN_EVERY == 0:
                            learned = self._learn(client, round_.tick, round_.waiting)
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

    def _learn(self, client: BootstrapClient, pace: Callable[[], None] = lambda: None,
               waiting: Callable[[], AbstractContextManager] | None = None) -> bool:
        """Hand on the transfer sessions of this node's ranks, every DP
        group (``pace()`` before each: a round gives the interpreter lock up
        between groups; each reply waited for inside ``waiting()``); True
        when every group answered ready."""
        sessions, complete = {self.rank.session}, True
        for dp in range(self.config.dp_size):
            pace()
            try:
                reply = client.lookup(self.config.node_id, dp, pace=pace, waiting=waiting)
            except KVFerryError as exc:
                log.debug("%s: looking up this node's ranks: %s", self.where, exc)
                complete = False
                continue
            complete = complete and reply.ready
            sessions.update(r.session for r in reply.ranks)
        self._on_sessions(frozenset(sessions))
        return complete
