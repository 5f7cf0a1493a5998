"""One decode room's use of the storage tier: prefetching its leading pages
before the request goes out, and restoring it after a failed transfer. The
room calls it under its lock; the tier calls back on its own thread."""

from __future__ import annotations

import logging

import numpy as np

from bootstrap.messages import PoolRole
from transfer.pools import host_page_ids
from transfer.storage.tier import Job, StorageTier

log = logging.getLogger("kvferry.receiver")


class RoomStorage:
    """``tokens`` (the prompt) and ``pages`` (decode page ids, request order)
    of one room; ``aux_index`` -1 when the room has no aux row."""

    def __init__(self, tier: StorageTier, token_ids, pages: np.ndarray, aux_index: int) -> None:
        """Raises ValueError when the prompt does not take ``len(pages)`` pages."""
        tokens = host_page_ids(token_ids)  # a CUDA tensor too
        if -(-tokens.size // tier.page_size) != pages.size:
            raise ValueError(f"{tokens.size} tokens take {-(-tokens.size // tier.page_size)} pages of "
                             f"{tier.page_size}, not the {pages.size} given")
        self.tier, self.tokens, self.pages, self.aux_index = tier, tokens, pages, aux_index
        self.num_full_pages = len(tier.chains(tokens))
        self._prefetch: Job | None = None  # loading the leading pages before the request goes out
        self._restore: Job | None = None  # loading the pages of a failed room

    def items(self, start: int) -> dict:
        """Per pool of this rank: (keys, destination pages) of the full pages
        from request position ``start`` on."""
        chains = self.tier.chains(self.tokens)
        pages = self.pages[start:len(chains)].tolist()
        return {role: (self.tier.keys(role, chains[start:]), pages) for role in self.tier.pools}

    @property
    def prefetching(self) -> bool:
        """Whether a prefetch runs (started and not settled yet)."""
        return self._prefetch is not None

    def prefetch(self, done, start: int = 0) -> None:
        """Load the pages storage has from request position ``start`` on, up
        to the first missing one (``done(job)`` on the tier's thread)."""
        self._prefetch = self.tier.read(self.items(start), None, done)

    @property
    def loading(self) -> bool:
        """Whether the prefetch may still write into the pages: started, and
        its job not finished (a cancelled job ends its batch in progress first)."""
        return self._prefetch is not None and not self._prefetch.finished

    def cancel_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.cancel()

    def prefetched(self, waited_s: float, config) -> int | None:
        """How many leading pages the prefetch loaded, once it settled (it is
        then done with); None while it runs. Per ``config.storage_prefetch``:
        ``best_effort`` stops it at once, ``timeout`` after
        ``storage_prefetch_timeout_s`` (the batch being loaded ends first),
        ``wait_complete`` waits."""
        job = self._prefetch
        if not job.finished:
            policy = config.storage_prefetch
            if policy == "best_effort" or (policy == "timeout" and waited_s > config.storage_prefetch_timeout_s):
                job.cancel()
            return None
        self._prefetch = None
        return min(job.pages.values(), default=0) if job.error is None else 0

    def restore(self, start: int, done) -> None:
        """Load the full pages from ``start`` on, and the aux row."""
        aux = (self.tier.aux_key(self.tokens), self.aux_index) if self.aux_index >= 0 else None
        self._restore = self.tier.read(self.items(start), aux, done)

    def is_restore(self, job: Job) -> bool:
        """Whether ``job`` is the restore's (not the prefetch's)."""
        return job is self._restore

    def shortfall(self, job: Job, start: int, *, allow_missing_draft: bool, where: str) -> tuple[list[str], bool]:
        """What a restore from ``start`` left missing (empty: the room is
        whole), and whether the draft pages are all there (missing draft
        pages are tolerated with ``allow_missing_draft``)."""
        full, missing, draft_ok = self.num_full_pages, [], True
        if job.error is not None:
            missing.append(f"storage failed: {job.error}")
        for role in self.tier.pools:
            got = start + job.pages.get(role, 0)
            if got < full:
                if role is PoolRole.DRAFT and allow_missing_draft:
                    log.warning("%s: draft pages [%d, %d) not in storage; going on without draft KV "
                                "(allow_missing_draft)", where, got, full)
                    draft_ok = False
                    continue
                missing.append(f"{role.value} pages [{got}, {full}) not in storage")
        if full < len(self.pages):
            missing.append(f"page {full} (the last, partly filled) is never stored")
        if self.aux_index >= 0 and not job.aux_ok:
            missing.append("the aux row is not in storage")
        return missing, draft_ok
