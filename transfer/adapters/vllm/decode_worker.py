"""Decode's worker half (``kv_consumer``): a kvferry room per request that
claimed its prompt as an external load, received into the blocks vLLM
allocated. A failed room reports the blocks it writes as load errors (one
KV-cache group) or its request id as a failed receive (several, with vLLM's
hybrid manager: block ids are unique only within a group). A queued request
holds its room at prefill (``RoomHold``, renewed until it is scheduled); a
request that ends before it had a room tells prefill at once."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from transfer.adapters.vllm.params import RecvSpec
from transfer.adapters.vllm.query import KvferryAddresses
from transfer.adapters.vllm.worker import WAKE_S, KvferryWorker, Room
from transfer.config import Role
from transfer.errors import KVFerryError
from transfer.state import KVPoll

log = logging.getLogger("kvferry.vllm")

_FIRST_HOLD_S = 1.0  # a queued request's first RoomHold goes out this long after it came
_HOLD_RETRY_S = 0.2  # a hold not sent (its prefill node being looked up) is tried again this soon


def written_blocks(r: RecvSpec) -> list[int]:
    """The blocks a decode room writes (its load errors if it fails): the
    pages after the prefix cache's, and every wanted state block."""
    return list(r.pages[r.skip_pages:]) + [b for items in r.states for b in items if b >= 0]


@dataclass
class _Hold:
    """A queued request's room, held at prefill until it is scheduled or cancelled."""

    spec: RecvSpec
    due: float  # when the next RoomHold goes (time.monotonic())


class DecodeWorker(KvferryWorker):
    """Receives the rooms of one vLLM decode worker rank."""

    role = Role.DECODE
    discovery_type = "D"
    abort_why = "the request finished on decode before its KV arrived"

    #: a queued request's room is held at prefill this long (RoomHold) ...
    hold_s = 20.0
    #: ... renewed this often until the request is scheduled (its room opens) or dropped
    hold_every_s = 5.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kvferry_addr = KvferryAddresses()  # a request's bootstrap address -> kvferry's ZMQ server
        self._load_errors: set[int] = set()  # one KV-cache group: the blocks of failed receives
        self._failed_recvs: set[str] = set()  # several groups: the failed receives' request ids
        self._failed_out: set[str] = set()  # those of them finished() has reported
        # vLLM maps block-level load errors back to requests only where block ids are unique, one KV-cache
        # group; with several (HMA) it takes failed receives by request id and raises on block ids
        self._fail_by_request = self.groups is not None and self.groups.num_groups > 1
        self.num_cancelled = 0  # requests prefill was told of before they had a room
        self._holds: dict[str, _Hold] = {}  # req_id -> its hold, for queued requests
        self.num_holds = 0  # RoomHolds sent

    # --- vLLM's calls ------------------------------------------------------------

    def take(self, meta) -> None:
        """A step's :class:`~transfer.adapters.vllm.metadata.DecodeMetadata`."""
        if meta.recvs or meta.aborts or meta.cancels or meta.holds:
            self.start(meta.recvs, aborts=meta.aborts, cancels=meta.cancels, holds=meta.holds)

    def start(self, recvs: list[RecvSpec], aborts: list[str] = (), cancels: list[RecvSpec] = (),
              holds: list[RecvSpec] = ()) -> None:
        """Open this step's rooms, abort those of ``aborts`` (requests vLLM
        finished while their KV was coming), tell prefill of ``cancels``
        (requests vLLM finished before they had a room: prefill frees their
        blocks now, not at its lease), and hold the rooms of ``holds`` at
        prefill (requests queued, not scheduled yet: prefill keeps their
        blocks past its lease, renewed until they are scheduled or
        cancelled). A room that cannot open is reported done, its blocks as
        load errors, at the next ``finished``."""
        from transfer.rooms.receiver import KVReceiver

        if holds or self._holds:
            first = time.monotonic() + min(_FIRST_HOLD_S, self.hold_every_s)
            with self._lock:  # a request scheduled at once needs no hold: the first goes out a bit later
                for h in holds:
                    self._holds[h.req_id] = _Hold(h, first)
                for r in (*recvs, *cancels):
                    self._holds.pop(r.req_id, None)
        self._cancel(cancels)
        self._abort(aborts)
        opened: list[Room] = []
        for r in recvs:
            try:
                receiver = KVReceiver(self.mgr, self._kvferry_addr(r.bootstrap_addr), r.room, prefill_node=r.node_id)
                receiver.init(r.pages, token_ids=list(r.token_ids) or None, skip_pages=r.skip_pages,
                              state_indices=list(r.states) or None)
            except KVFerryError as exc:
                log.warning("kvferry: request %s (room %d) not received: %s", r.req_id, r.room, exc)
                with self._lock:
                    self._not_opened(r.req_id, exc)
                    self._load_failed(r.req_id, written_blocks(r))
                continue
            # its load errors, if it fails: the blocks it writes (never the prefix cache's)
            opened.append(self._list(Room(r.req_id, receiver, tuple(written_blocks(r)))))
        if opened:  # its pages may have landed before it was listed
            try:
                self._poll(opened)
            except Exception:  # never into vLLM's step; the manager's sweep and the driver go on
                log.exception("kvferry: poll after opening rooms failed")

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """The receives that ended since the last call; the failed among
        them are in ``load_errors()`` or ``failed_receives()``."""
        with self._lock:
            done, self._done = self._done, set()
            self._failed_out |= self._failed_recvs & done  # failed and reported finished: for failed_receives()
            self._failed_recvs -= done
            return set(), done

    def load_errors(self) -> set[int]:
        """The blocks of receives that failed since the last call (one KV-cache group)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
            return errors

    def failed_receives(self) -> set[str]:
        """The request ids of receives that failed, among those ``finished``
        reported since the last call (several KV-cache groups)."""
        with self._lock:
            failed, self._failed_out = self._failed_out, set()
            return failed

    # --- rooms and the driver's parts ------------------------------------------------

    def _cancel(self, cancels: list[RecvSpec]) -> None:
        """A receiver aborted before its first poll: the room table looks the
        prefill node up and sends the abort once it is known (within
        ``bootstrap_timeout_s``); nothing of it is listed or reported."""
        from transfer.rooms.receiver import KVReceiver

        for c in cancels:
            try:
                KVReceiver(self.mgr, self._kvferry_addr(c.bootstrap_addr), c.room, prefill_node=c.node_id).abort(
                    f"decode does not need request {c.req_id}'s KV (finished before it was scheduled, or its "
                    "own prefix cache holds the prompt)")
                self.num_cancelled += 1
            except KVFerryError as exc:
                log.warning("kvferry: prefill not told that request %s (room %d) was cancelled: %s", c.req_id,
                            c.room, exc)

    def _load_failed(self, req_id: str, blocks) -> None:
        """A receive failed (the lock held): its blocks are load errors, or,
        with several KV-cache groups, its request id a failed receive."""
        if self._fail_by_request:
            self._failed_recvs.add(req_id)
        else:
            self._load_errors.update(blocks)

    def _ended(self, room: Room, state: KVPoll) -> None:
        if state is KVPoll.Failed and not room.aborted:
            self._load_failed(room.req_id, room.pages)

    def _due(self) -> float:
        """Send the RoomHolds that are due (``hold_every_s`` apart per
        request, sooner while its prefill node is looked up); returns the
        seconds until the next one is due."""
        if not self._holds:
            return WAKE_S
        now = time.monotonic()
        with self._lock:
            due = [h for h in self._holds.values() if h.due <= now]
        for h in due:
            spec = h.spec
            try:
                sent = self.mgr.hold_room(self._kvferry_addr(spec.bootstrap_addr), spec.room, prefill_node=spec.node_id,
                                          hold_s=self.hold_s)
            except KVFerryError as exc:
                log.warning("kvferry: request %s (room %d) not held at prefill: %s", spec.req_id, spec.room, exc)
                sent = False
            self.num_holds += sent
            h.due = now + (self.hold_every_s if sent else min(self.hold_every_s, _HOLD_RETRY_S))
        with self._lock:
            return max(0.0, min(WAKE_S, min((h.due for h in self._holds.values()), default=WAKE_S) - now))
