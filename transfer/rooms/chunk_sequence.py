"""Prefill side: a room's ``send()`` calls, assembled into its chunks. Pure (numpy).

A room's pages (``init()``'s count) go in chunks, in request order: each
chunk starts where the previous ended, its staged parts are numbered on
from the previous chunk's, and the chunk marked ``last`` ends the room (it
must end at the room's last page; :mod:`transfer.rooms.chunk_plan` checks).
A chunk goes whole, or as layer groups (:mod:`transfer.rooms.layer_groups`:
the rule, and :class:`ChunkGroups`, one chunk's groups): the room moves on
only once every layer of the chunk was sent. A room shorter than
``layerwise_min_tokens`` holds its groups and sends the chunk whole with its
completing group (streaming would not pay for its calls). State items given
with any group of the last chunk go with its completing group.

:class:`ChunkSequence` checks each call, says what it sends
(:class:`ChunkSend`), and moves on once its room planned it. Its room (the
:class:`~transfer.rooms.sender.KVSender`) calls it under the rank's lock, on
the scheduler's thread (``init()``, ``send()``). Nothing blocks but the copy
of page ids given as a CUDA tensor to the host (it waits for the stream that
produced them). A call out of turn, or one that does not fit the chunk under
way, raises StateError, naming the room (``where``) and what is wrong, and
changes nothing; page ids that are not integers raise what numpy raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bootstrap.messages import PoolDescriptor
from transfer.errors import StateError
from transfer.pools import host_page_ids
from transfer.rooms.chunk_plan import Chunk
from transfer.rooms.layer_groups import ChunkGroups, by_pool, layer_spans, num_layers, parse_layers
from transfer.state import KVPoll


@dataclass(frozen=True)
class ChunkSend:
    """What one ``send()`` call sends: ``chunk`` (a whole chunk, or one
    layer group of it) with ``states`` (the last chunk's state items, per
    state pool; empty: none given). ``last``: as the call said it;
    ``complete``: once planned, the chunk is done and the room moves on."""

    chunk: Chunk
    states: tuple
    last: bool
    complete: bool


class ChunkSequence:
    """The chunks of the room ``where`` names, over the rank's ``pools`` (in
    order: the room's layers are theirs, target first), whose layer groups
    go whole under ``min_tokens`` prompt tokens. Not thread-safe: its room
    locks."""

    def __init__(self, where: str, pools: Sequence[PoolDescriptor], min_tokens: int) -> None:
        self.where, self.pools, self.min_tokens = where, pools, min_tokens
        #: the room's pages (None before ``init()``) and aux slot on this rank (None: no aux row)
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        #: where the next chunk starts (request position), and its first staged part's number
        self.offset = 0
        self.next_part = 0
        #: the chunk marked last was sent (planned)
        self.last_sent = False
        self._groups: ChunkGroups | None = None  # the chunk whose layer groups are being sent

    def init(self, num_pages, aux_index: int | None) -> None:
        """``init()``'s count (an int) and aux slot; StateError the second time."""
        if self.num_pages is not None:
            raise StateError(f"{self.where}: init() called twice")
        self.num_pages, self.aux_index = int(num_pages), aux_index

    def check_next(self, state: KVPoll) -> None:
        """A chunk may be sent in room state ``state``: after ``init()``, in
        WaitingForInput or Transferring, before the last chunk (else StateError)."""
        if self.num_pages is None:
            raise StateError(f"{self.where}: send() before init()")
        if state not in (KVPoll.WaitingForInput, KVPoll.Transferring) or self.last_sent:
            raise StateError(f"{self.where}: send() in state {state.name}"
                             + (" after the last chunk" if self.last_sent else ""))

    def arguments(self, page_indices, last: bool, state_indices, layers) -> tuple[np.ndarray, tuple]:
        """A ``send()``'s pages and state items (per state pool: None, or
        item indices) as host arrays; StateError for state items without
        ``last``, or a whole chunk while a chunk lacks layers."""
        pages = host_page_ids(page_indices)
        if state_indices is not None and not last:
            raise StateError(f"{self.where}: state indices go with the last chunk (last=True)")
        if layers is None and self._groups is not None:
            raise StateError(f"{self.where}: send() of a whole chunk while the chunk at page "
                             f"{self.offset} still lacks layer(s) {self._groups.missing()[:8]}")
        states = () if state_indices is None else \
            tuple(None if i is None else host_page_ids(i) for i in state_indices)
        return pages, states

    def whole(self, pages: np.ndarray, last: bool, states: tuple) -> ChunkSend:
        """A whole chunk of ``pages`` (no chunk under way: see :meth:`arguments`)."""
        return ChunkSend(Chunk(pages, self.offset, last, self.next_part), states, last, complete=True)

    def group(self, pages: np.ndarray, last: bool, layers, states: tuple) -> ChunkSend | None:
        """The group of ``layers`` (room layers) of the chunk of ``pages``;
        None when it sends nothing yet (a held chunk's group that does not
        complete it). StateError for a group that names no layer, one
        outside the room's or sent already, or other pages or ``last`` than
        its chunk's first group."""
        spans = layer_spans(self.pools)
        try:
            wanted = parse_layers(layers, num_layers(spans))
            if self._groups is None:
                self._groups = ChunkGroups(pages, last, num_layers(spans))
                tokens = self.num_pages * self.pools[0].page_size
                self._groups.deferred = tokens < self.min_tokens
            self._groups.add(pages, last, wanted)
        except ValueError as exc:
            raise StateError(f"{self.where}: {exc}") from None
        groups = self._groups
        groups.states = states or groups.states  # state items go with the completing group of the last chunk
        complete = groups.complete
        if not groups.deferred:
            chunk = Chunk(pages, self.offset, last and complete, self.next_part, layers=by_pool(wanted, spans))
            return ChunkSend(chunk, groups.states, last, complete)
        if complete:  # a held chunk goes whole, gated on its completing group's event
            return ChunkSend(Chunk(pages, self.offset, last, self.next_part), groups.states, last, complete=True)
        return None

    def planned(self, send: ChunkSend, next_part: int) -> None:
        """``send`` was planned, its staged parts numbered up to ``next_part``."""
        if send.complete:
            self._groups = None
            self.offset += send.chunk.pages.size
            self.last_sent = send.last
        self.next_part = next_part
