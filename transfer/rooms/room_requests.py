"""Prefill side: the decode requests one room takes. Pure.

A room takes one :class:`~transfer.messages.TransferRequest` per decode TP
rank that expects its KV from this prefill rank, as many as the first said
(``num_requests``), each for as many pages as the room has (``init()``'s
count). A request from a session whose handshake no longer holds is dropped,
one seen before is dropped, one the room cannot take is refused at once
(its receiver fails, the room goes on): each counted by the rank's room
table (:class:`~transfer.rooms.prefill_table.PrefillRooms`). The room waits
for its requests ``bootstrap_timeout_s`` from its creation, or longer while
a decode rank holds it (``RoomHold``).

Its room (the :class:`~transfer.rooms.sender.KVSender`) calls it under the
rank's lock, from the control thread (messages, holds), the scheduler's
(``init()``, ``decode_prefix_pages``) or the liveness thread (timeouts).
Nothing blocks; it fails nothing: it names the problems, as errors of the
room's (``where``), and the room fails itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from transfer.errors import KVTimeoutError, RequestError, StateError
from transfer.messages import INDEX_ITEMSIZE, RoomAbort, TransferRequest


class RequestTable(Protocol):
    """What the room's requests need of the rank's room table."""

    def is_peer(self, session: str, origin: str, endpoint: str | None = None) -> bool: ...

    def refused_unhandshaken(self) -> None: ...

    def dropped_replay(self) -> None: ...

    def refuse_request(self, req: TransferRequest, reason: str) -> None: ...


class RoomRequests:
    """The requests that arrived for the room ``where`` names, in arrival
    order, and until when (monotonic) a decode rank holds the room (0:
    never held). Not thread-safe: the room calls it under its lock."""

    def __init__(self, where: str, table: RequestTable) -> None:
        self.where, self.table = where, table
        self._requests: list[TransferRequest] = []
        self.held_until = 0.0

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[TransferRequest]:
        return iter(self._requests)

    @property
    def awaiting(self) -> bool:
        """Whether requests are still to come (none yet, or fewer than the first said)."""
        return not self._requests or len(self._requests) < self._requests[0].num_requests

    def ids(self) -> list[int]:
        return [r.request_id for r in self._requests]

    def peers(self) -> str:
        """The decode sessions of the requests, sorted, comma-separated (for a failure's line)."""
        return ",".join(sorted({r.decode_session for r in self._requests}))

    def take(self, req: TransferRequest) -> bool:
        """Take ``req`` unless its handshake no longer holds (it changed
        since the table took the request), it came before, or it cannot join
        (:meth:`duplicate`: refused). True when it was the last the room expects."""
        if not self.table.is_peer(req.decode_session, "", req.decode_endpoint):
            self.table.refused_unhandshaken()  # its handshake changed since the table took it
            return False
        if req.request_id in self.ids():
            self.table.dropped_replay()
            return False
        problem = self.duplicate(req)
        if problem:
            self.table.refuse_request(req, problem)
            return False
        self._requests.append(req)
        return len(self._requests) == req.num_requests

    def duplicate(self, req: TransferRequest) -> str:
        """Why ``req`` cannot join the room's requests ("" if it can): a
        room takes one request per decode TP rank, as many as the first said."""
        if not self._requests:
            return ""
        if not self.awaiting:
            return f"it has all the {self._requests[0].num_requests} decode request(s) it expects"
        if req.num_requests != self._requests[0].num_requests:
            return f"it expects {self._requests[0].num_requests} decode requests, this one says {req.num_requests}"
        if req.decode_tp_rank in [r.decode_tp_rank for r in self._requests]:
            return f"it already has a request from decode TP rank {req.decode_tp_rank}"
        return ""

    def aborted_by(self, abort: RoomAbort) -> bool:
        """Whether ``abort`` ends the room: it names one of the room's
        requests, or the room awaits requests and none came from its
        session. (An abort of a request not here yet is for the request that
        session would send: the table took it from a handshaken peer, or one
        whose handshake was refused for its layout.)"""
        return abort.request_id in self.ids() or (
            self.awaiting and abort.session not in [r.decode_session for r in self._requests])

    def size_errors(self, num_pages: int) -> list[RequestError]:
        """A RequestError for each request whose decode pages are not ``num_pages``."""
        return [RequestError(f"{self.where}: decode rank {req.decode_tp_rank} allocated "
                             f"{len(req.dst_pages) // INDEX_ITEMSIZE} pages, this request has {num_pages}")
                for req in self._requests if len(req.dst_pages) // INDEX_ITEMSIZE != num_pages]

    def prefix_pages(self) -> int:
        """The leading pages every decode rank of the room holds; StateError
        before every request arrived, or when they said different numbers."""
        if self.awaiting:
            raise StateError(f"{self.where}: decode_prefix_pages before every decode request arrived")
        prefixes = {r.prefix_pages for r in self._requests}
        if len(prefixes) > 1:
            raise StateError(f"{self.where}: decode ranks hold different prefixes: "
                             + ", ".join(f"rank {r.decode_tp_rank} {r.prefix_pages} pages"
                                         for r in sorted(self._requests, key=lambda r: r.decode_tp_rank)))
        return prefixes.pop()

    def hold(self, until: float) -> None:
        """A decode rank holds the room until ``until`` (monotonic): its requests may come later."""
        self.held_until = max(self.held_until, until)

    def overdue(self, now: float, created: float, timeout_s: float) -> KVTimeoutError | None:
        """Why the room, made at ``created``, waited too long for its
        requests (None: it did not): longer than ``timeout_s``, and past any hold."""
        if now - created <= timeout_s or now <= self.held_until:
            return None
        held = f" (decode held it until {now - self.held_until:.1f} s ago)" if self.held_until else ""
        return KVTimeoutError(
            f"{self.where}: {len(self._requests)} decode request(s) arrived within {timeout_s:g} s{held}, expected "
            f"{self._requests[0].num_requests if self._requests else 'at least 1'}")
