"""One decode room's use of the storage tier: prefetching its leading pages
before the request goes out, and restoring it after a failed transfer; what
each loaded, counted in the room's stats and moving the pages prefill skips.
The room calls it under its lock; the tier calls back on its own thread."""

from __future__ import annotations

import logging

from bootstrap.messages import PoolRole
from transfer.pools import host_page_ids
from transfer.rooms.decode_request import RoomRequest
from transfer.rooms.room_stats import RoomCounts
from transfer.storage.tier import Job, StorageTier

log = logging.getLogger("kvferry.receiver")


class RoomStorage:
    """``token_ids`` (the prompt) and the :class:`RoomRequest` of one room,
    whose loads are counted in ``counts``."""

    def __init__(self, tier: StorageTier, token_ids, request: RoomRequest, counts: RoomCounts) -> None:
        """Raises ValueError when the prompt does not take the request's pages."""
        tokens = host_page_ids(token_ids)  # a CUDA tensor too
        if -(-tokens.size // tier.page_size) != request.pages.size:
            raise ValueError(f"{tokens.size} tokens take {-(-tokens.size // tier.page_size)} pages of "
                             f"{tier.page_size}, not the {request.pages.size} given")
        self.tier, self.tokens, self.request, self.counts = tier, tokens, request, counts
        self.num_full_pages = len(tier.chains(tokens))
        #: pages of the room loaded from storage (a prefetch, or a restore)
        self.pages_loaded = 0
        #: False when a restore tolerated missing draft pages (``allow_missing_draft``)
        self.draft_ok = True
        self._prefetch: Job | None = None  # loading the leading pages before the request goes out

    def items(self, start: int) -> dict:
        """Per pool of this rank: (keys, destination pages) of the full pages
        from request position ``start`` on."""
        chains = self.tier.chains(self.tokens)
        pages = self.request.pages[start:len(chains)].tolist()
        return {role: (self.tier.keys(role, chains[start:]), pages) for role in self.tier.pools}

    @property
    def prefetching(self) -> bool:
        """Whether a prefetch runs (started and not settled yet)."""
        return self._prefetch is not None

    def prefetch(self, done) -> None:
        """Load the pages storage has after those the scheduler holds, up to
        the first missing one (``done(job)`` on the tier's thread)."""
        self._prefetch = self.tier.read(self.items(self.request.prefix), None, done)

    @property
    def loading(self) -> bool:
        """Whether the prefetch may still write into the pages: started, and
        its job not finished (a cancelled job ends its batch in progress first)."""
        return self._prefetch is not None and not self._prefetch.finished

    def cancel_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.cancel()

    def prefetched(self, waited_s: float, config) -> bool:
        """Whether the prefetch settled (it is then done with): what it
        loaded is counted, and prefill skips it. Per
        ``config.storage_prefetch``: ``best_effort`` stops it at once,
        ``timeout`` after ``storage_prefetch_timeout_s`` (the batch being
        loaded ends first), ``wait_complete`` waits."""
        job = self._prefetch
        if not job.finished:
            policy = config.storage_prefetch
            if policy == "best_effort" or (policy == "timeout" and waited_s > config.storage_prefetch_timeout_s):
                job.cancel()
            return False
        self._prefetch = None
        loaded = min(job.pages.values(), default=0) if job.error is None else 0
        self.pages_loaded = loaded
        self.request.skip = self.request.prefix + loaded  # it ran from the held prefix on: the larger end
        self.counts.storage({role: loaded for role in self.tier.pools}, loaded, aux=False)
        return True

    def restore(self, done) -> None:
        """Load the full pages prefill was to send, and the aux row."""
        aux_index = self.request.aux_index
        aux = (self.tier.aux_key(self.tokens), aux_index) if aux_index >= 0 else None
        self.tier.read(self.items(self.request.skip), aux, done)

    def restored(self, job: Job, *, allow_missing_draft: bool, where: str) -> list[str]:
        """What the restore left missing (empty: the room is whole; what it
        loaded is then counted)."""
        missing, self.draft_ok = self._shortfall(job, allow_missing_draft=allow_missing_draft, where=where)
        if not missing:
            self.pages_loaded = max(0, self.num_full_pages - self.request.prefix)
            self.counts.storage(job.pages, self.num_full_pages - self.request.skip, aux=job.aux_ok)
        return missing

    def _shortfall(self, job: Job, *, allow_missing_draft: bool, where: str) -> tuple[list[str], bool]:
        """What the restore (from the skipped pages on) left missing, and whether the draft
        pages are all there (missing draft pages are tolerated with
        ``allow_missing_draft``)."""
        full, missing, draft_ok, start = self.num_full_pages, [], True, self.request.skip
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
        if full < len(self.request.pages):
            missing.append(f"page {full} (the last, partly filled) is never stored")
        if self.request.aux_index >= 0 and not job.aux_ok:
            missing.append("the aux row is not in storage")
        return missing, draft_ok
