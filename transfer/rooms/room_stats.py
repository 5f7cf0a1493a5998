"""What one room's bytes are, for its :class:`~transfer.stats.RoomCounter`:
the sizes of what landed, from the pool layouts (called under ``ctx.lock``).

Prefill counts each job's planned bytes and descriptors when the job
completes, and a staged part's packed bytes when its write lands. Decode
cannot see direct (one-sided) writes: it counts a staged part when it
scatters it, and, when a prefill rank reports its part done, the pages that
rank did not stage (times each sent pool's page slice) and the aux row.
"""

from __future__ import annotations

import logging

from bootstrap.messages import RankInfo
from transfer.plan import page_slice, staged_bytes
from transfer.stats import RoomCounter, failure_line

log = logging.getLogger("kvferry.rooms")


class RoomCounts:
    """A room's counter, with the first-byte debug line."""

    def __init__(self, counter: RoomCounter, rank: RankInfo, where: str) -> None:
        self.counter, self.rank, self.where = counter, rank, where
        # decode: (prefill rank, pool role) -> pages x layers of that pool the rank sent through staging
        self.staged_layers: dict[tuple, int] = {}

    def land(self, pool: str, path: str, num_bytes: int, num_descriptors: int = 0) -> None:
        if self.counter.first_byte_at is None:
            log.debug("%s: first byte landed (%s)", self.where, path)
        self.counter.add(pool, path, num_bytes, num_descriptors)

    def ended(self, error: BaseException | None, *, side: str, config, peer: str = "") -> None:
        """The room ended (``error`` None: Success): count it, and log its one
        line (a failure: WARNING with node, rank, room, peer and reason)."""
        reason = self.counter.done(error)
        if error is None:
            log.debug("%s: done (%d bytes)", self.where, self.counter.total_bytes)
        else:
            c = self.counter
            log.warning("%s", failure_line(side=side, config=config, room=c.room, peer=peer, reason=reason,
                                           error=error, age_s=c.done_at - c.requested_at))

    # --- prefill ------------------------------------------------------------------------

    def part_landed(self, part) -> None:
        """A staged part (:mod:`transfer.rooms.parts`) was written: what it
        moved (a layer group's share counts as a part of its own: one more
        write)."""
        for role, nbytes, descriptors in part.moved():
            self.land(role, "staged", nbytes, descriptors)
        self.counter.add_part()

    # --- decode -------------------------------------------------------------------------

    def staged(self, p: int, assignments, num_pages: int, layers=None) -> None:
        """A staged part from prefill rank ``p`` was scattered: ``num_pages``
        of the pools it sends (``assignments``), or of only ``layers`` of
        them (each pool's, by role: a layer group's share)."""
        descriptors = 1  # a staged part is one descriptor, under its first pool
        for a in (a for a in assignments if a.send):
            pool = self.rank.pool(a.role)
            n = pool.num_layers if layers is None else len(layers.get(a.role, ()))
            if n and num_pages > 0:
                self.staged_layers[(p, a.role)] = self.staged_layers.get((p, a.role), 0) + num_pages * n
                self.land(a.role.value, "staged", staged_bytes(pool, _dst_slice(pool, a), num_pages, n), descriptors)
                descriptors = 0
        self.counter.add_part()

    def rank_done(self, p: int, assignments, num_pages: int, with_aux: bool) -> None:
        """Prefill rank ``p`` reported its part done: ``num_pages`` were asked
        of it; what it did not stage it wrote directly."""
        for a in (a for a in assignments if a.send):
            pool = self.rank.pool(a.role)
            direct = num_pages * pool.num_layers - self.staged_layers.get((p, a.role), 0)
            if direct > 0:
                self.land(a.role.value, "direct", staged_bytes(pool, _dst_slice(pool, a), direct, 1))
        if with_aux and self.rank.aux:
            self.land("aux", "direct", sum(a.slot_bytes for a in self.rank.aux))
        self.counter.landed()

    def storage(self, pages_by_role: dict, num_pages: int, *, aux: bool) -> None:
        """Pages (at most ``num_pages`` of each pool) and the aux row loaded from storage."""
        for role, n in pages_by_role.items():
            pool = self.rank.pool(role)
            n = min(n, num_pages)
            if n > 0 and pool is not None:
                self.land(role.value, "storage", n * pool.page_bytes * len(pool.buffers))
        if aux and self.rank.aux:
            self.land("aux", "storage", sum(a.slot_bytes for a in self.rank.aux))


def _dst_slice(pool, a):
    """What assignment ``a`` sends of each page of this (decode) rank's ``pool``."""
    return page_slice(pool, a.dst_head_offset, a.num_heads)
