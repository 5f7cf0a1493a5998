"""The KVManager's stats snapshot (:meth:`KVManager.stats`). A base class of
:class:`transfer.manager.KVManager` (the same object's state)."""

from __future__ import annotations

from transfer.rooms.prefill_table import PrefillRooms
from transfer.stats import ManagerStats


class ManagerStatsView:
    """``stats()`` of a :class:`KVManager`."""

    def stats(self) -> ManagerStats:
        """This rank's totals since it started (a frozen copy; any time, from
        any thread): rooms by final state and failure reason, bytes and
        descriptors by pool and path, live rooms, peers, control messages,
        staging and storage (see :class:`~transfer.stats.ManagerStats`)."""
        ch, tier, staging = self.channel, self.storage, self.context.staging
        storage = {}
        if tier is not None:
            storage = dict(storage_pages={("read", "hit"): tier.num_pages_read, ("read", "miss"): tier.num_pages_missed,
                                          ("write", "written"): tier.num_pages_written,
                                          ("write", "present"): tier.num_pages_present,
                                          ("write", "failed"): tier.num_pages_failed},
                           storage_bytes={"read": tier.num_bytes_read, "write": tier.num_bytes_written})
        with self._lock:
            rooms = self.rooms
            return self._totals.snapshot(
                live_rooms=len(rooms.senders) if isinstance(rooms, PrefillRooms) else len(rooms.receivers),
                peers_live=self.liveness.num_watched, control_received=ch.num_received,
                control_malformed=ch.num_malformed, control_unauthenticated=ch.num_unauthenticated,
                staging_capacity_bytes=staging.area.nbytes if staging is not None else 0,
                staging_bytes_in_use=staging.area.nbytes - staging.area.free_bytes if staging is not None else 0,
                **storage)
