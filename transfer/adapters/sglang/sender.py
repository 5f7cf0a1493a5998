"""KvferryKVSender: SGLang's prefill sender slot over a kvferry KVSender.

SGLang's call sequence: create (when the request is scheduled), ``poll`` until
WaitingForInput (every decode rank's request arrived), ``pop_decode_prefix_len``
(tokens decode already holds: SGLang then sends only what follows), ``init``
with the page count of that suffix and the aux slot, ``send`` per chunk (no
last flag: the chunk that completes the page count is the last; an empty one
works; the last one names the room's state items per state type,
``state_indices``), ``poll`` until Success or Failed.

Decode's prefix maps onto kvferry's "decode holds the leading N pages"
request field: decode adds N placeholder pages before its suffix pages and
asks for the skip; here ``init`` counts them and the first ``send`` puts N
placeholders before its pages. kvferry never reads or writes them.

The prompt: SGLang's interface passes none; kvferry's plugin hook hands it over
right after SGLang made the sender (:mod:`.prompts`), and ``init`` passes it on,
so that a manager with a storage tier (``KVFERRY_STORAGE_URL``) writes the sent
pages and the aux row through, keyed by it.
"""

from __future__ import annotations

import time

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVSender, KVTransferMetric

from transfer.adapters.sglang.failure import fail_room, raise_failure
from transfer.adapters.sglang.prompts import prompt_of_room
from transfer.errors import KVFerryError, StateError, TransferError
from transfer.rooms.sender import KVSender
from transfer.state import KVPoll


class KvferryKVSender(BaseKVSender):
    def __init__(self, mgr, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room)
        self.bootstrap_server_url = bootstrap_addr
        self.conclude_state: KVPoll | None = None
        self._error: BaseException | None = None
        self._num_pages: int | None = None
        self._aux_index: int | None = None
        self._prefix_pages = 0
        self._token_ids = None  # the prompt (learn_prompt), for the storage tier's keys
        self._num_sent = 0
        self._last_sent = False
        self._state_indices = None  # per SGLang state type: this room's items (with the last chunk)
        self._started_s: float | None = None
        self._latency_s: float | None = None
        # Set by SGLang's prefill before an early send of a cached prefix under overlap scheduling: the
        # previous step's forward may still be writing those pages; that chunk's read waits for it.
        self._early_send_wait_event = None
        if mgr.rooms_registrar is not None:  # the prefill routes rooms to DP ranks by another rule than room % dp
            mgr.rooms_registrar.register(self.bootstrap_room)
        try:
            self._core = KVSender(mgr.core, bootstrap_addr, self.bootstrap_room)
        except KVFerryError as exc:  # a live sender holds the room id, or the manager closed
            self._core = None
            self._fail(exc)

    # --- BaseKVSender -----------------------------------------------------------------
    def pop_decode_prefix_len(self) -> int:
        """Tokens decode already holds (page-aligned): the leading pages its
        requests asked kvferry to skip. Called once every request arrived."""
        if self._core is None or self.conclude_state is not None:
            return 0
        try:
            self._prefix_pages = self._core.decode_prefix_pages
        except KVFerryError as exc:  # decode ranks differ, or not every request arrived
            self._fail(exc)
            return 0
        return self._prefix_pages * self.kv_mgr.page_size

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._num_pages, self._aux_index = int(num_kv_indices), aux_index
        if self._core is None or self.conclude_state is not None:
            return
        try:
            num_pages = self._prefix_pages + self._num_pages
            tokens = prompt_of_room(self._token_ids, num_pages, self.kv_mgr.page_size, f"room {self.bootstrap_room}")
            self._core.init(num_pages, aux_index, token_ids=tokens)
        except KVFerryError as exc:
            self._fail(exc)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk  # an empty last chunk still ends the room

    def send(self, kv_indices, state_indices: list | None = None, num_kv_tokens: int | None = None,
             **_unused) -> None:
        if self.conclude_state is not None or self._core is None or self._last_sent:
            return
        if self._num_pages is None:
            self._fail(StateError(f"room {self.bootstrap_room}: send() before init()"))
            return
        if state_indices is not None:  # SGLang names them with the last chunk; kept if it named them earlier
            self._state_indices = state_indices
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        if self._num_sent == 0 and self._prefix_pages:
            pages = np.concatenate([np.zeros(self._prefix_pages, dtype=np.int64), pages])
        self._num_sent += int(np.asarray(kv_indices).size)
        last = self._num_sent >= self._num_pages
        if self._num_sent > self._num_pages:
            self._fail(TransferError(f"room {self.bootstrap_room}: {self._num_sent} pages sent, more than the "
                                     f"{self._num_pages} of init()"))
            return
        if self._started_s is None:
            self._started_s = time.perf_counter()
        if last:  # the aux rows go with it: SGLang wrote them right before this call
            self._last_sent = True
        ready, self._early_send_wait_event = self._early_send_wait_event, None  # it belongs to this chunk only
        try:
            self._core.send(pages, last=last, ready=ready, state_indices=self._state_indices if last else None)
        except KVFerryError as exc:
            self._fail(exc)

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        state = self._core.poll()
        if state in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = state
            if state is KVPoll.Success and self._started_s is not None:
                self._latency_s = time.perf_counter() - self._started_s
        return state

    def poll_pp_consensus(self) -> KVPoll:
        return self.poll()

    def failure_exception(self) -> None:
        raise_failure(self._error, self._core, self.bootstrap_room, "prefill")

    def abort(self) -> None:
        if self._core is not None:
            self._core.abort()
        else:
            self.conclude_state = KVPoll.Failed

    def clear(self) -> None:
        pass

    def get_transfer_metric(self) -> KVTransferMetric:
        stats = self.transfer_stats()
        return KVTransferMetric(transfer_latency_s=self._latency_s, transfer_total_bytes=stats.bytes)

    # --- kvferry extras ----------------------------------------------------------------
    def learn_prompt(self, token_ids) -> None:
        """The request's prompt (SGLang's ``origin_input_ids``), before ``init``."""
        self._token_ids = token_ids

    def transfer_stats(self):
        """Bytes and descriptors this room moved (the core's ``KVSender.stats()``,
        a :class:`transfer.stats.RoomStats`, in the shape of :class:`.stats.RoomStats`)."""
        from transfer.adapters.sglang.stats import RoomStats

        if self._core is None:
            return RoomStats()
        core = self._core.stats()
        return RoomStats(bytes=core.total_bytes, descriptors=core.total_descriptors)

    def _fail(self, error: BaseException) -> None:
        fail_room(self, error, "sender")
