"""How a failed decode room ends (phases DRAINING and RESTORING of
:mod:`transfer.rooms.decode_phases`).

Once nothing writes into the room's pages any more (the prefill ranks of its
:class:`~transfer.rooms.drain.Drain`, and the room's own local writes: a
staged part being scattered, a storage prefetch's batch, which the room
reports with each call), it is restored from storage when it may fall back,
else Failed. Either way it is counted (one line for a failure) and leaves
the rank's room table (``remove()``). A :class:`Failure` is how the room's
collaborators say what went wrong, for the room's ``fail()``.

Pure. Its room calls it under ``ctx.lock``, on whatever thread holds it;
nothing here blocks (a restore is queued on the storage tier, whose thread
calls the room back; the room then takes the lock and calls
:meth:`RoomEnding.restored`) and nothing raises.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from collections.abc import Callable

from transfer.errors import StorageMissError
from transfer.rooms.decode_phases import ENDING, LIVE, DecodePhase, DecodePhases
from transfer.rooms.drain import Drain

if TYPE_CHECKING:
    from transfer.config import ManagerConfig
    from transfer.rooms.decode_link import RoomLink
    from transfer.rooms.room_stats import RoomCounts
    from transfer.rooms.room_storage import RoomStorage

log = logging.getLogger("kvferry.receiver")

P = DecodePhase


@dataclass(frozen=True)
class Failure:
    """Why a room is to fail, and how (``KVReceiver.fail``'s arguments):
    ``stopped``, its prefill ranks known to write no more; ``notify``: tell
    the prefill ranks; ``fall_back``: it may be restored from storage."""

    error: BaseException
    stopped: frozenset[int] = frozenset()
    notify: bool = True
    fall_back: bool = True


class RoomEnding:
    """The end of the room whose phases are ``phases``, counted in
    ``counts``; ``prefill`` names its peer in the failure line, ``remove()``
    takes the room out of the rank's table."""

    def __init__(self, phases: DecodePhases, counts: RoomCounts, config: ManagerConfig, prefill: RoomLink,
                 remove: Callable[[], None]) -> None:
        self._phases, self._counts, self._config, self._prefill, self._remove = phases, counts, config, prefill, remove
        #: DRAINING: the ranks that may still write; DRAINING, RESTORING: why the room failed
        self.drain = Drain()
        self._fallback: RoomStorage | None = None  # restore from it once drained (None: fail)
        self._on_restore: Callable | None = None

    def fall_back_to(self, storage: RoomStorage | None, done: Callable) -> None:
        """Called as the room fails: once drained, restore it from ``storage``
        (None: it may not), ``done(job)`` called on the tier's thread (kept
        only until the restore starts: it closes over the room's storage
        steps, which hold this ending, a cycle)."""
        self._fallback, self._on_restore = storage, done if storage is not None else None

    def begin(self, error: BaseException, writing: set[int], *, drain: bool, local_writes: bool) -> None:
        """The room failed with ``error``; ``writing``: its prefill ranks
        that may still write (told to stop, or not told). ``drain`` False
        (a closing manager): end at once, those ranks given up on."""
        self.drain.writers_lost |= bool(writing) and not drain
        if (writing or local_writes) and drain:  # a scatter or a prefetch batch: wait for it too
            log.debug("%s failing, waiting for prefill ranks %s to stop writing: %s", self._phases.where,
                      sorted(writing), error)
            self.drain.start(error, writing, time.monotonic() + self._config.peer_timeout_s)
            self._phases.move(P.DRAINING)
            return
        self._finish(error)

    def poll(self, now: float, *, local_writes: bool) -> None:
        """DRAINING (the room's ``update()``): end once nothing writes, or
        once the bound passed with ranks left (given up on: logged)."""
        if self._phases.phase is P.DRAINING and not local_writes and self.drain.overdue(now):
            log.info("%s: prefill ranks %s did not confirm they stopped writing within %g s",
                     self._phases.where, sorted(self.drain.ranks), self._config.peer_timeout_s)
            self._finish(self.drain.error)
        elif self._phases.phase is P.DRAINING and not local_writes and not self.drain.ranks:
            self._finish(self.drain.error)  # the last local write (a storage prefetch) ended

    def write_ended(self, now: float, *, local_writes: bool) -> None:
        """One of the room's local writes (a scatter) ended: DRAINING ends if
        nothing writes any more, or the bound passed."""
        if self._phases.phase is P.DRAINING and not local_writes and \
                (not self.drain.ranks or self.drain.overdue(now)):
            self._finish(self.drain.error)

    def stopped(self, tp_rank: int, *, local_writes: bool, lost: bool = False) -> None:
        """A draining room's prefill rank writes no more (``lost``: it was
        found dead, not told)."""
        if tp_rank in self.drain.ranks and self.drain.stopped(tp_rank, lost=lost) and not local_writes:
            self._finish(self.drain.error)

    def ranks_lost(self, ranks: set[int], *, local_writes: bool) -> None:
        """Prefill ranks that may still write were found dead: given up on
        (a late write of theirs is possible); while ending, each writes no
        more."""
        self.drain.writers_lost = True
        if self._phases.phase in ENDING:
            for p in ranks:
                self.stopped(p, local_writes=local_writes, lost=True)

    def restored(self, job) -> None:
        """The restore's job ended (the room holds the lock): Success when
        the room is whole, else Failed with what is missing."""
        if self._phases.phase is not P.RESTORING:
            return
        error = self.drain.error
        missing = self._fallback.restored(job, allow_missing_draft=self._config.allow_missing_draft,
                                          where=self._phases.where)
        if missing:
            self._fail(StorageMissError(f"{error}; restoring from storage failed: {'; '.join(missing)}"))
            return
        self._counts.ended(None, side="decode", config=self._config)
        log.warning("%s: restored from storage after: %s", self._phases.where, error)
        self._phases.move(P.SUCCESS)
        self._remove()

    def _finish(self, error: BaseException) -> None:
        """Nothing writes into the pages any more: restore them from storage,
        or fail."""
        if self._phases.phase not in LIVE | {P.DRAINING}:
            return
        if self._fallback is not None:
            log.debug("%s: transfer failed (%s); restoring the room from storage", self._phases.where, error)
            self.drain.error = error
            self._phases.move(P.RESTORING)
            done, self._on_restore = self._on_restore, None
            self._fallback.restore(done)
            return
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        if not self._phases.fail(error):
            return
        self._remove()
        self._counts.ended(error, side="decode", config=self._config, peer=self._prefill.peer)
