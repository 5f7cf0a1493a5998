"""A failing decode room's drain: the prefill ranks that may still write into
its pages, until each confirmed it stopped, was found dead, or the bound
passed. Only then may the room report Failed, and the scheduler reuse the
pages. Pure; its room calls it under its lock."""

from __future__ import annotations


class Drain:
    def __init__(self) -> None:
        #: why the room failed (set by :meth:`start`)
        self.error: BaseException | None = None
        #: prefill TP ranks that may still write
        self.ranks: set[int] = set()
        #: a rank that may still write was given up on without its word
        #: (it stopped answering, or the bound passed): its late writes are possible
        self.writers_lost = False
        self._deadline = 0.0

    def start(self, error: BaseException, ranks: set[int], deadline: float) -> None:
        self.error, self.ranks, self._deadline = error, set(ranks), deadline

    def stopped(self, rank: int, *, lost: bool = False) -> bool:
        """``rank`` writes no more (``lost``: found dead, not told); True
        when no rank is left."""
        if rank in self.ranks:
            self.ranks.discard(rank)
            self.writers_lost |= lost
        return not self.ranks

    def overdue(self, now: float) -> bool:
        """Whether the bound passed with ranks left (they count as lost)."""
        if self.ranks and now > self._deadline:
            self.writers_lost = True
            return True
        return False
