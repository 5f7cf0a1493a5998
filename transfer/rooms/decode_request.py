"""What a decode room asks of its prefill ranks: the decode pages (request
order), the aux slot and the state items ``KVReceiver.init`` was given,
checked against the rank's pools; the leading pages prefill skips; and the
:class:`~transfer.messages.TransferRequest` each contacted rank gets. Pure
(numpy); the room calls it under its lock."""

from __future__ import annotations

import numpy as np

from bootstrap.messages import PoolRole, RankInfo
from transfer.errors import PageIndexError, RequestError
from transfer.messages import INDEX_DTYPE, TransferRequest
from transfer.pools import host_page_ids


def _state_items(states, state_indices, where: str) -> tuple:
    """Per state pool of the rank (in order): the item indices as int32, or
    None where the room fills none of it (raises RequestError)."""
    if state_indices is None:
        return ()
    given = list(state_indices)
    if len(given) > len(states):
        raise RequestError(f"{where}: {len(given)} state index lists for the rank's {len(states)} state pool(s)")
    out = []
    for pool, items in zip(states, given, strict=False):  # fewer lists: the rest are not filled
        if items is None:
            out.append(None)
            continue
        ids = host_page_ids(items)
        if ids.size and (ids.min() < -1 or ids.max() >= pool.num_items):
            raise RequestError(f"{where}: state {pool.kind}: item index outside its {pool.num_items} items "
                               "(-1: not wanted)")
        out.append(ids.astype(INDEX_DTYPE))
    return tuple(out)


class RoomRequest:
    """A decode room's destination. ``pages``: decode page ids (int32,
    request order); ``aux_index``: its aux slot (-1: none); ``states``: per
    state pool, the item indices (None: not this pool); ``prefix``: leading
    pages the scheduler holds (``init``'s ``skip_pages``); ``skip``: leading
    pages held or prefetched from storage, which prefill does not send (at
    least ``prefix``; it grows when a prefetch settles)."""

    def __init__(self, pages: np.ndarray, aux_index: int, states: tuple, prefix: int) -> None:
        self.pages, self.aux_index, self.states = pages, aux_index, states
        self.prefix = self.skip = prefix
        self._wire_pages = pages.tobytes()  # encoded once: every contacted rank's request carries it

    @classmethod
    def checked(cls, rank: RankInfo, where: str, page_indices, aux_index: int | None, skip_pages: int,
                state_indices) -> RoomRequest:
        """``init``'s arguments checked against ``rank``'s pools: raises
        PageIndexError (a page outside the target pool) or RequestError."""
        pages = host_page_ids(page_indices)
        target = rank.pool(PoolRole.TARGET)
        if pages.size and (pages.min() < 0 or pages.max() >= target.num_pages):
            raise PageIndexError(f"{where}: page index outside the pool of {target.num_pages}")
        if not 0 <= int(skip_pages) <= pages.size:
            raise RequestError(f"{where}: skip_pages {skip_pages} outside the request's {pages.size} pages")
        states = _state_items(rank.states, state_indices, where)
        return cls(pages.astype(INDEX_DTYPE), -1 if aux_index is None else int(aux_index), states, int(skip_pages))

    @property
    def has_state(self) -> bool:
        """Whether the room fills any state pool (such a room is never restored from storage)."""
        return any(s is not None for s in self.states)

    @property
    def num_sent(self) -> int:
        """Pages prefill sends: those after the skipped ones."""
        return len(self.pages) - self.skip

    def message(self, link, p: int, rank: RankInfo, room: int, request_id: int, staging: tuple[int, int]
                ) -> TransferRequest:
        """What prefill rank ``p`` of ``link`` is asked for, from decode rank
        ``rank``; ``staging``: the region granted with it (offset -1: none)."""
        offset, nbytes = staging
        return TransferRequest(
            room=room, request_id=request_id, decode_session=rank.session, decode_endpoint=rank.control_endpoint,
            decode_tp_rank=rank.tp_rank, dst_pages=self._wire_pages,
            dst_aux_index=self.aux_index if p == link.aux_rank else -1, assignments=link.routes[p],
            num_requests=link.num_requests[p], skip_pages=self.skip, prefix_pages=self.prefix,
            staging_offset=offset, staging_nbytes=nbytes, dst_states=self._dst_states(link, p))

    def _dst_states(self, link, p: int) -> tuple[bytes, ...]:
        """Per state pool, the items if ``p`` is that pool's sender to this
        rank (empty: not); empty altogether without state."""
        if not self.has_state:
            return ()
        return tuple(s.tobytes() if s is not None and p in link.state_ranks[i] else b""
                     for i, s in enumerate(self.states))
