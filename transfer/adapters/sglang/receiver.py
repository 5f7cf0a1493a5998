"""KvferryKVReceiver: SGLang's decode receiver slot over a kvferry KVReceiver.

SGLang's call sequence: create (the request arrived with its bootstrap
address and room), ``init(prefill_dp_rank)`` once the prefill DP rank is known
(``KvferryKVManager.try_ensure_parallel_info`` resolves the node's DP/TP
sizes), ``send_metadata`` with the decode pages of the part prefill sends, the
aux slot and ``decode_prefix_len`` (tokens decode already holds), then ``poll``
until Success (the aux rows landed in SGLang's regions before Success is
returned) or Failed.

Failure and page reuse: kvferry reports Failed only after every prefill rank
that may still write into the room's pages stopped (drain and fence), so
SGLang may free the pages at once. When SGLang fails the room because another
rank failed (its MIN all-reduce) while this rank's room is live,
``ensure_abort_notified`` aborts it here and ``is_abort_release_safe`` stays
False until the drain ended: SGLang's deferred decode KV release
(``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``) waits for exactly that.

PD retract rebootstrap: a retracted request comes back as a new receiver for
the same room, through the same calls; its leader's manager then asks the
prefill server to recompute the room (``submit_prefill_recompute``) and hands
this receiver the call (:meth:`KvferryKVReceiver.watch_recompute`): ``poll()``
fails the room with the call's error once it failed or ran past its bound,
unless the KV landed first. kvferry keys a room's requests by (room, request
id), so a room id used again picks up nothing of its last use.

The prompt: kvferry's plugin hook hands it over right after SGLang made the
receiver (:mod:`.prompts`; not for a rebootstrap), and ``send_metadata``
passes it on. With a storage tier (``KVFERRY_STORAGE_URL``), the room then
loads the leading pages the store has before asking prefill for the rest,
and a room whose prefill died or failed is restored from the store (its pages
and the aux row prefill wrote through) and ends in Success. A restored aux
row is the one prefill wrote for the room it sent then: before ``poll()``
returns Success, the row's ``bootstrap_room`` field (SGLang's check that a
row belongs to the request, :class:`MetadataBuffers`) gets this room's id,
as SGLang's prefill writes it into every row it sends.
"""

from __future__ import annotations

import time

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVReceiver

from transfer.adapters.sglang.manager import PREFILL_NODE
from transfer.adapters.sglang.failure import fail_room, raise_failure
from transfer.adapters.sglang.prompts import prompt_of_room
from transfer.adapters.sglang.recompute import RecomputeCall
from transfer.errors import BootstrapUnavailable, KVFerryError, StateError, TransferError
from transfer.rooms.receiver import KVReceiver
from transfer.state import KVPoll


class KvferryKVReceiver(BaseKVReceiver):
    def __init__(self, mgr, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.conclude_state: KVPoll | None = None
        self.abort_notified = False
        self.require_staging = False
        self.bootstrap_infos: list = []
        self._core: KVReceiver | None = None
        self._error: BaseException | None = None
        self._recompute: RecomputeCall | None = None  # PD retract rebootstrap: the prefill asked to recompute
        self._token_ids = None  # the prompt (learn_prompt), for the storage tier's keys
        self._room_rows = None  # SGLang's MetadataBuffers.bootstrap_room (learn_prompt)
        self._aux_index: int | None = None

    @property
    def supports_host_destination(self) -> bool:
        return False

    # --- BaseKVReceiver ---------------------------------------------------------------
    def init(self, prefill_dp_rank: int) -> None:
        if self._core is not None or self.conclude_state is not None:
            return
        addr = self.kv_mgr.kvferry_address(self.bootstrap_addr)
        if addr is None:
            self._fail(BootstrapUnavailable(f"room {self.bootstrap_room}: SGLang bootstrap {self.bootstrap_addr} "
                                            "does not say where kvferry's bootstrap server is (GET /kvferry)"))
            return
        try:
            self._core = KVReceiver(self.kv_mgr.core, addr, self.bootstrap_room,
                                    prefill_node=PREFILL_NODE, prefill_dp_rank=int(prefill_dp_rank))
        except KVFerryError as exc:
            self._fail(exc)
            return
        self.kv_mgr.receivers[self.bootstrap_room] = self

    def send_metadata(self, kv_indices, aux_index: int | None = None, state_indices: list | None = None,
                      decode_prefix_len: int | None = None, destination=None, **_unused) -> None:
        if self.conclude_state is not None:
            return
        if self._core is None:
            self._fail(StateError(f"room {self.bootstrap_room}: send_metadata() before init()"))
            return
        if destination is not None and str(getattr(destination, "value", destination)) != "device":
            self._fail(TransferError(f"room {self.bootstrap_room}: {destination} destinations are not supported"))
            return
        prefix_tokens = int(decode_prefix_len or 0)
        if prefix_tokens % self.kv_mgr.page_size:
            self._fail(TransferError(f"room {self.bootstrap_room}: decode prefix of {prefix_tokens} tokens is not "
                                     f"whole pages of {self.kv_mgr.page_size}"))
            return
        prefix_pages = prefix_tokens // self.kv_mgr.page_size
        self._aux_index = aux_index
        pages = np.asarray(kv_indices, dtype=np.int64).reshape(-1)
        # Placeholders for the pages decode holds: never written (skip_pages).
        pages = np.concatenate([np.zeros(prefix_pages, dtype=np.int64), pages])
        try:
            tokens = prompt_of_room(self._token_ids, pages.size, self.kv_mgr.page_size, f"room {self.bootstrap_room}")
            self._core.init(pages, aux_index, token_ids=tokens, skip_pages=prefix_pages, state_indices=state_indices)
        except KVFerryError as exc:
            self._fail(exc)

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        if self._core is None:
            return KVPoll.Bootstrapping
        state = self._core.poll()
        if state not in (KVPoll.Success, KVPoll.Failed) and self._recompute is not None:
            error = self._recompute.error(time.monotonic())
            if error is not None:  # the prefill will not send this room: stop it (its peers told), fail it
                self._recompute = None
                self._fail(error)
                state = KVPoll.Failed if self.conclude_state is KVPoll.Failed else self._core.poll()
        if state is KVPoll.Success:
            self._stamp_restored_row()
        if state in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = state
        return state

    def learn_prompt(self, token_ids, room_rows=None) -> None:
        """The request's prompt (SGLang's ``origin_input_ids``), before
        ``send_metadata``; ``room_rows``: SGLang's ``bootstrap_room`` aux
        buffer, stamped in a row restored from storage."""
        self._token_ids, self._room_rows = token_ids, room_rows

    def _stamp_restored_row(self) -> None:
        """The aux row came from storage: it names the room prefill sent when it wrote it through."""
        if self._room_rows is None or self._aux_index is None or self._aux_index < 0:
            return
        if ("aux", "storage") in self._core.stats().bytes:
            self._room_rows[self._aux_index, 0] = self.bootstrap_room

    def watch_recompute(self, call: RecomputeCall) -> None:
        """The prefill server was asked to recompute this room (PD retract
        rebootstrap, :meth:`.manager.KvferryKVManager.submit_prefill_recompute`):
        ``poll()`` fails the room with ``call``'s error, if it has one before
        the room ended."""
        self._recompute = call

    def failure_exception(self) -> None:
        raise_failure(self._error, self._core, self.bootstrap_room, "decode")

    def abort(self) -> None:
        self.abort_notified = True
        if self._core is not None:
            self._core.abort()
        else:
            self.conclude_state = KVPoll.Failed

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """SGLang failed the room (maybe for another rank): stop this rank's
        prefill writers; the pages are safe once ``is_abort_release_safe``."""
        if self._core is not None and self._core.poll() not in (KVPoll.Success, KVPoll.Failed):
            self.abort()

    def is_abort_release_safe(self) -> bool:
        """No prefill rank can write into this room's pages any more."""
        return self._core is None or not self._core.ranks_writing() and \
            self._core.poll() in (KVPoll.Success, KVPoll.Failed)

    def clear(self) -> None:
        if self.kv_mgr.receivers.get(self.bootstrap_room) is self:
            del self.kv_mgr.receivers[self.bootstrap_room]

    def _fail(self, error: BaseException) -> None:
        fail_room(self, error, "receiver")
