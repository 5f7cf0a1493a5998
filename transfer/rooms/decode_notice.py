"""Prefill side: telling a room's decode ranks how it ended. Pure.

Each decode request of the room gets one :class:`~transfer.messages.RoomStatus`:

- SUCCESS once every write of the room landed (its pages are decode's now),
  naming the pools this rank wrote, with the seconds since the scheduler's
  forward pass ended (``exposed_s``: from its last ``send()``, or that
  call's ready event completing, if later), and, for a fenced decode rank
  whose aux row this rank sends, the row itself;
- FAILED, with the failure's text, once a failed room has no write in
  flight any more (decode may then reuse its pages), at most once; not when
  the room's failure says decode knows already.

``aborted`` tells decode that the prefill scheduler gave the request up
(decode then does not restore it from storage).

:class:`DecodeNotice` is called by its room (the
:class:`~transfer.rooms.sender.KVSender`) under the rank's lock, from any
thread: the scheduler's for :meth:`DecodeNotice.forward_sent`, a transport,
staging or control thread for the rest. Nothing blocks (the channel's
``send`` queues). What the channel raises (ClosedError, TransferError), or
reading the aux row, goes to the caller of :meth:`DecodeNotice.succeed`
(the room then fails); :meth:`DecodeNotice.tell_failure` logs it (the room
failed either way).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING
from collections.abc import Callable, Iterable, Mapping

from bootstrap.messages import RankInfo
from transfer.messages import RoomStatus, Status, TransferRequest

if TYPE_CHECKING:
    from transfer.ready import ReadyGate
    from transfer.rooms.context import RoomContext

log = logging.getLogger("kvferry.sender")


class DecodeNotice:
    """The statuses of room ``room`` (``where`` names it) from the rank of
    ``ctx``, sent on its channel to the decode ranks in ``peers`` (session
    -> rank info, the room table's handshaken ones: whether a rank is
    fenced). ``read_aux_row(aux, slot)``: the bytes of one row of the rank's
    aux regions (``ctx.aux``). Not thread-safe: its room locks."""

    def __init__(self, ctx: RoomContext, room: int, where: str, peers: Mapping[str, RankInfo],
                 read_aux_row: Callable[[tuple, int], bytes]) -> None:
        self.ctx, self.room, self.where, self.peers, self.read_aux_row = ctx, room, where, peers, read_aux_row
        #: the prefill scheduler aborted the room (set by the room before it fails)
        self.aborted = False
        #: decode was told of the room's success
        self.told_success = False
        self._failure_note: str | None = None  # to send decode once nothing is in flight
        self._last_send_at: float | None = None  # the last send() call (the end of the scheduler's forward)
        self._last_gate: ReadyGate | None = None  # its ready gate: with an event, the forward ends when it completes

    def forward_sent(self, gate: ReadyGate | None) -> None:
        """The scheduler called ``send()`` now, with this ready gate."""
        self._last_send_at, self._last_gate = time.monotonic(), gate

    def succeed(self, requests: Iterable[TransferRequest], aux_index: int | None) -> None:
        """Tell each request's decode rank that every write landed
        (``aux_index``: this rank's aux slot of the room, None: none)."""
        self._send(requests, Status.SUCCESS, "", aux_index)
        self.told_success = True

    def fail_later(self, note: str | None) -> None:
        """The room failed: tell decode ``note`` once it is drained (None: do not)."""
        self._failure_note = note

    def tell_failure(self, requests: Iterable[TransferRequest]) -> None:
        """The failed room has no write in flight: send its failure, once
        (nothing when there is none to send); a send that raises is logged,
        not retried."""
        if self._failure_note is None:
            return
        note, self._failure_note = self._failure_note, None
        try:
            self._send(requests, Status.FAILED, note, None)
        except Exception as exc:  # the room is failed either way
            log.warning("%s: could not tell decode: %s", self.where, exc)

    def _forward_end(self) -> float:
        """When the scheduler's forward ended as this rank saw it: its last
        ``send()`` call, or, when that call passed a ready event, the event's
        completion (an engine on a GPU calls ``send()`` as it launches the
        work, before the work is done)."""
        gate = self._last_gate
        done_at = gate.done_at if gate is not None else None
        return self._last_send_at if done_at is None else max(self._last_send_at, done_at)

    def _send(self, requests: Iterable[TransferRequest], status: Status, reason: str, aux_index: int | None) -> None:
        exposed = time.monotonic() - self._forward_end() \
            if status is Status.SUCCESS and self._last_send_at is not None else 0.0
        for req in requests:
            sent = tuple(a.role for a in req.assignments if a.send)
            row, peer = b"", self.peers.get(req.decode_session)
            if status is Status.SUCCESS and req.dst_aux_index >= 0 and aux_index is not None \
                    and self.ctx.aux and peer is not None and peer.fenced:
                row = self.read_aux_row(self.ctx.aux, aux_index)  # a fenced rank's aux is not writable
            self.ctx.channel.send(req.decode_endpoint, RoomStatus(
                room=self.room, request_id=req.request_id, prefill_tp_rank=self.ctx.rank.tp_rank,
                status=status, sent=sent if status is Status.SUCCESS else (), reason=reason,
                aborted=self.aborted, aux_row=row, exposed_s=exposed))
