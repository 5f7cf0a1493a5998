"""The decode room's storage side and its end: a settled prefetch, the fall
back to restoring a failed room from storage, and the final failure. A base
class of :class:`transfer.receiver.KVReceiver` (the same object's state)."""

from __future__ import annotations

import logging

from transfer.errors import StorageMissError
from transfer.rooms.decode_phases import LIVE, DecodePhase

log = logging.getLogger("kvferry.receiver")

P = DecodePhase


class ReceiverRestore:
    """Storage prefetch, restore-on-failure and final failure of a :class:`KVReceiver`."""

    def _storage_done(self, job) -> None:
        if job is self._restore:
            self._restore_done(job)
        else:
            self.poll()  # a settled prefetch lets the request go out now

    def _prefetched(self, now: float) -> bool:
        """Whether the prefetch settled (per the policy); records what it loaded."""
        if self._prefetch is not None:
            loaded = self._storage.settled(self._prefetch, now - self._init_at, self._ctx.config)
            if loaded is None:
                return False
            self._prefetch = None
            self.pages_from_storage = loaded
            self._skip = self._prefix + loaded  # it ran from the held prefix on: the larger end
            self._ctx.stats.prefetch_wait_seconds.observe(now - self._init_at)
            self._counts.storage({role: loaded for role in self._ctx.storage.pools}, loaded, aux=False)
        return True

    def _finish_fail(self, error: BaseException) -> None:
        """Nothing writes into the pages any more: restore them from storage,
        or fail."""
        if self._phases.phase not in LIVE | {P.DRAINING}:
            return
        if self._may_fall_back:
            log.debug("%s: transfer failed (%s); restoring the room from storage", self.where, error)
            self._failure = error
            self._phases.move(P.RESTORING)
            self._restore = self._storage.restore(self._skip, self._storage_done)
            return
        self._really_fail(error)

    def _restore_done(self, job) -> None:
        with self._ctx.lock:
            if self._phases.phase is not P.RESTORING:
                return
            error = self._failure
            missing, self.draft_restored = self._storage.shortfall(
                job, self._skip, allow_missing_draft=self._ctx.config.allow_missing_draft, where=self.where)
            if missing:
                self._really_fail(StorageMissError(f"{error}; restoring from storage failed: {'; '.join(missing)}"))
                return
            self.pages_from_storage = max(0, self._storage.num_full_pages - self._prefix)
            self._counts.storage(job.pages, self._storage.num_full_pages - self._skip, aux=job.aux_ok)
            self._counts.ended(None, side="decode", config=self._ctx.config)
            log.warning("%s: restored from storage after: %s", self.where, error)
            self._phases.move(P.SUCCESS)
            self._table.remove(self)

    def _really_fail(self, error: BaseException) -> None:
        if not self._phases.fail(error):
            return
        self._table.remove(self)
        link = self._link
        peer = ",".join(sorted({link.ranks[p].session for p in link.routes})) if link is not None and link.ranks \
            else f"{self.prefill_node}/dp{'?' if self.prefill_dp_rank is None else self.prefill_dp_rank}"
        self._counts.ended(error, side="decode", config=self._ctx.config, peer=peer)
