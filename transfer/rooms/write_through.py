"""A prefill room's write-through: each sent chunk's full pages (and, with the
last chunk, the aux row) written to the storage tier in the background, so
that a later decode can load them by prefix instead of asking prefill.

The transfer never waits for storage to answer, but a room is reported done
only once its writes ended (they read the room's pages, which the scheduler
must not reuse before). A failed write is logged; the transfer is unaffected.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from bootstrap.messages import AttentionKind, RankInfo
from transfer.storage.tier import Job, StorageTier

log = logging.getLogger("kvferry.sender")


class WriteThrough:
    """One room's writes to ``tier``: ``chains`` are the prompt's page chain
    hashes, ``aux_key`` its aux row's key. Not thread-safe: its owner calls
    it under the room's lock, also :meth:`settle` (from ``done``)."""

    def __init__(self, tier: StorageTier, rank: RankInfo, chains: list[bytes], aux_key: str, where: str) -> None:
        self.tier, self.rank, self.chains, self.aux_key, self.where = tier, rank, chains, aux_key, where
        #: writes queued and not ended yet
        self.num_pending = 0

    def write(self, pages: np.ndarray, first: int, aux_index: int | None, done: Callable[[Job], None],
              ready=None) -> None:
        """Queue the full pages of a chunk that starts at request position
        ``first``, and with ``aux_index`` (the last chunk's) the aux row.
        MLA pools are the same on every TP rank: only rank 0 writes them,
        and the aux row. ``done(job)`` runs on the tier's thread (the owner
        then calls :meth:`settle`); ``ready``: a
        :class:`~transfer.ready.ReadyGate` the tier waits for first."""
        tier, rank = self.tier, self.rank
        end = min(first + pages.size, len(self.chains))
        items = {}
        if end > first:
            chains = self.chains[first:end]
            for role in tier.pools:
                if rank.pool(role).attention is AttentionKind.MLA and rank.tp_rank != 0:
                    continue
                items[role] = (tier.keys(role, chains), pages[:end - first].tolist())
        aux = (self.aux_key, aux_index) if aux_index is not None and rank.tp_rank == 0 and tier.has_aux else None
        if not items and aux is None:
            return
        self.num_pending += 1
        tier.write(items, aux, done, ready=ready)

    def settle(self, job: Job) -> None:
        """A write's job ended."""
        self.num_pending -= 1
        if job.error is not None:
            log.warning("%s: write-through failed (the transfer is not affected): %s", self.where, job.error)
