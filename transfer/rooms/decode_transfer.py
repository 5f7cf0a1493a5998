"""A decode room's transfer: phases TRANSFERRING and RELINKING of
:mod:`transfer.rooms.decode_phases`, from the requests to Success.

It sends each contacted prefill rank of the room's link its request (a
staging region pregranted with it), keeps the ranks that have not reported
their part done and the pools each is to send, checks and counts each
rank's report (taking the aux row that travels in it), and keeps the staged
parts being scattered into the room's pages, counted when they end. The last
rank's report ends the room: Success. When every rank the room asked was
found gone before it took the request, the transfer starts over once, under
a new request id, with the node's link looked up afresh (RELINKING). Both
phases are bounded by ``transfer_timeout_s`` from the room's ``init``.

The room calls it under ``ctx.lock``, on whatever thread holds it (the
scheduler's, the control thread's, a scatter's, the liveness thread's).
Nothing here blocks: channel sends return at once, an aux row is a small
copy. Nothing raises: what fails the room is returned as a
:class:`~transfer.rooms.decode_ending.Failure`, and the room fails itself.
"""

from __future__ import annotations

import random
import time
from typing import Protocol

from bootstrap.messages import PoolRole
from transfer.errors import KVFerryError, KVTimeoutError, PeerError, ProtocolError, TransferError
from transfer.messages import ChunkStaged, RoomAbort, RoomStatus, Status
from transfer.rooms.context import RoomContext
from transfer.rooms.decode_ending import Failure
from transfer.rooms.decode_link import RoomLink
from transfer.rooms.decode_phases import DecodePhase, DecodePhases
from transfer.rooms.decode_request import RoomRequest
from transfer.rooms.links import LinkState
from transfer.rooms.request_acks import UnackedRequests
from transfer.rooms.room_stats import RoomCounts
from transfer.rooms.staged_decode import DecodeStaging, ScatterTarget, count_scattered, take_aux_row
from transfer.stats import FailureReason, tag_reason

P = DecodePhase
# The phases bounded by transfer_timeout_s from the room's init().
_TIMED = frozenset({P.TRANSFERRING, P.RELINKING})


class RequestTable(Protocol):
    """What the transfer needs of the rank's room table
    (:class:`~transfer.rooms.decode_table.DecodeRooms`), under ``ctx.lock``;
    ``receiver`` is the room's, which the table keys by room and request id."""

    unacked: UnackedRequests
    staging: DecodeStaging | None

    def add(self, receiver) -> None: ...

    def remove(self, receiver, *, writers_lost: bool | None = None) -> None: ...

    def pregrant(self, receiver, tp_rank: int, assignments, num_pages: int) -> tuple[int, int]: ...

    def request_sent(self, receiver, tp_rank: int, session: str) -> None: ...


def _new_request_id() -> int:
    return random.getrandbits(63) | 1


class RoomTransfer:
    """The transfer of the room whose phases are ``phases``, over its link
    ``prefill``; what landed is counted in ``counts``. The room's receiver
    comes with each call that needs it, never kept: a reference back to it
    would make a cycle that outlives the room until a garbage collection."""

    def __init__(self, ctx: RoomContext, table: RequestTable, prefill: RoomLink, counts: RoomCounts,
                 phases: DecodePhases) -> None:
        self._ctx, self._table, self._prefill, self._counts, self._phases = ctx, table, prefill, counts, phases
        #: the id of the room's requests (a new one when the transfer starts over)
        self.request_id = _new_request_id()
        self._request: RoomRequest | None = None  # from start()
        self._awaiting: dict[int, set[PoolRole]] = {}  # ranks not done yet, and their pools
        self._requested_at = 0.0  # when the requests went to prefill
        self._send_end = 0.0  # the latest prefill rank's forward end, on this clock (0: not known)
        #: staged parts being copied into the pages now (without the lock)
        self.num_scattering = 0

    @property
    def awaited(self) -> set[int]:
        """The prefill ranks asked that have not reported their part done."""
        return set(self._awaiting)

    def start(self, receiver, request: RoomRequest) -> Failure | None:
        """Enter TRANSFERRING: ask each prefill rank of the link for its part
        of ``request``, for ``receiver`` (each then awaited). A request that
        cannot go out (those before it went) fails the room."""
        self._request = request
        self._phases.move(P.TRANSFERRING)
        link = self._prefill.link
        self._requested_at = time.monotonic()
        for p, assignments in link.routes.items():
            self._awaiting[p] = {a.role for a in assignments if a.send}
        try:
            for p, assignments in link.routes.items():
                staging = self._table.pregrant(receiver, p, assignments, request.num_sent)
                self._ctx.channel.send(link.ranks[p].control_endpoint, request.message(
                    link, p, self._ctx.rank, receiver.room, self.request_id, staging))
                self._table.request_sent(receiver, p, link.ranks[p].session)
        except KVFerryError as exc:
            return Failure(exc)
        return None

    def on_report(self, receiver, msg: RoomStatus | RoomAbort) -> Failure | None:
        """A prefill rank's word to ``receiver``'s room while transferring: its abort, or its part
        failed, or its part done (its aux row then taken, what it delivered
        counted; the last rank awaited ends the room: Success). A report
        from a rank not awaited (a duplicate, a rank not asked) is ignored."""
        where = self._phases.where
        if isinstance(msg, RoomAbort):
            return Failure(tag_reason(PeerError(f"{where}: prefill aborted the room: {msg.reason}"),
                                      FailureReason.ABORTED), notify=False)
        p, link, request = msg.prefill_tp_rank, self._prefill.link, self._request
        rank = f"prefill rank {p} of {link.name}"
        if msg.status is Status.FAILED:
            error = PeerError(f"{where}: {rank} failed: {msg.reason}")
            return Failure(tag_reason(error, FailureReason.ABORTED) if msg.aborted else error,
                           stopped=frozenset({p}), fall_back=not msg.aborted)
        expected = self._awaiting.get(p)
        if expected is None:
            return None  # a duplicate or a rank we did not ask
        if set(msg.sent) != expected:
            return Failure(ProtocolError(f"{where}: {rank} sent pools {sorted(r.value for r in msg.sent)}, "
                                         f"expected {sorted(r.value for r in expected)}"), stopped=frozenset({p}))
        if msg.aux_row and (bad := take_aux_row(self._ctx, request.aux_index, msg.aux_row)):
            return Failure(ProtocolError(f"{where}: {rank} {bad}"), stopped=frozenset({p}))
        del self._awaiting[p]
        if msg.exposed_s > 0:  # when the rank's forward ended, on this clock (the message's flight not counted)
            self._send_end = max(self._send_end, time.monotonic() - msg.exposed_s)
        self._counts.rank_done(p, link.routes[p], request.num_sent,
                               with_aux=p == link.aux_rank and request.aux_index >= 0)
        if not self._awaiting:
            if self._send_end > 0:
                self._counts.counter.exposed(time.monotonic() - self._send_end)
            self._counts.ended(None, side="decode", config=self._ctx.config)
            self._phases.move(P.SUCCESS)
            self._table.remove(receiver)
        return None

    def request_lost(self, tp_rank: int) -> Failure | None:
        """Prefill rank ``tp_rank`` never took the room's request (see
        :mod:`transfer.rooms.request_acks`): it fails the room if awaited."""
        if self._phases.phase is not P.TRANSFERRING or tp_rank not in self._awaiting:
            return None
        return Failure(tag_reason(PeerError(
            f"{self._phases.where}: prefill rank {tp_rank} of {self._prefill.link.name} never took this room's "
            "request: it answered a liveness ping sent after it, without it (lost on the way, or dropped by "
            "prefill)"), FailureReason.REQUEST_LOST), stopped=frozenset({tp_rank}))

    def begin_scatter(self, msg: ChunkStaged) -> ScatterTarget | None:
        """Where a staged part goes (None: the room is not transferring, or
        the part's rank is not one it asked); it then counts as scattering
        until :meth:`end_scatter`."""
        link = self._prefill.link
        if self._phases.phase is not P.TRANSFERRING or msg.prefill_tp_rank not in link.routes:
            return None
        self.num_scattering += 1
        p = msg.prefill_tp_rank
        return ScatterTarget(self._request.pages, link.routes[p], self._request.states, link.ranks[p])

    def end_scatter(self, msg: ChunkStaged, error: BaseException | None) -> Failure | None:
        """A scatter :meth:`begin_scatter` allowed ended: counted if whole and
        the room still transfers; ``error`` (it failed) fails the room."""
        self.num_scattering -= 1
        if error is not None:
            return Failure(TransferError(f"{self._phases.where}: scattering staged part {msg.part}: {error}"))
        if self._phases.phase is P.TRANSFERRING:
            count_scattered(self._ctx, self._counts, msg, self._prefill.link.routes[msg.prefill_tp_rank])
        return None

    def may_relink(self, lost: set[int]) -> bool:
        """Whether the transfer may start over, its ranks ``lost`` being gone
        (:meth:`RoomLink.may_relink`): it transfers, every rank it asked is
        still awaited, none is scattering a staged part, no byte landed."""
        if self._phases.phase is not P.TRANSFERRING:
            return False
        untouched = (set(self._awaiting) == set(self._prefill.link.routes) and not self.num_scattering
                     and self._counts.counter.total_bytes == 0)
        return self._prefill.may_relink(lost, untouched,
                                        lambda session: self._table.unacked.pending(session, self.request_id))

    def relink(self, receiver) -> Failure | None:
        """Start over (see :meth:`may_relink`): drop the dead link's request
        (its staging grant retired with it) and wait in RELINKING for the
        node's link afresh, under a new request id."""
        self._ctx.stats.num_relinked += 1
        self._table.remove(receiver, writers_lost=True)  # the dead writer's staging regions are retired, not reused
        self.request_id = _new_request_id()
        self._prefill.drop()
        self._awaiting = {}
        self._phases.move(P.RELINKING)
        self._table.add(receiver)
        return self.relinked(receiver)

    def relinked(self, receiver) -> Failure | None:
        """RELINKING: once the node's new link is ready, send the requests (a
        failed link fails the room)."""
        link = self._prefill.take()
        if link is not None and link.state is LinkState.FAILED:
            return Failure(link.error)
        return self.start(receiver, self._request) if link is not None else None

    def overdue(self, receiver, now: float, since: float) -> Failure | None:
        """The room's bound in TRANSFERRING and RELINKING:
        ``transfer_timeout_s`` from its ``init`` (``since``); past it the
        room fails, naming what is late."""
        timeout_s = self._ctx.config.transfer_timeout_s
        if self._phases.phase not in _TIMED or now - since <= timeout_s:
            return None
        staging = self._table.staging
        return Failure(KVTimeoutError(
            f"{self._phases.where}: no completion from prefill ranks {sorted(self._awaiting)} of "
            f"{self._prefill.name} within {timeout_s:g} s "
            f"[{self._counts.counter.total_bytes} bytes landed, {self.num_scattering} scatter(s) running, "
            f"requests sent {now - self._requested_at:.1f} s ago"
            + (f"; {staging.describe(receiver.room, self.request_id)}" if staging is not None else "") + "]"))
