"""Decode side: the requests each prefill rank has not acknowledged yet. Pure.

A prefill rank handles a decode rank's control messages in the order they
were sent, and its pong to a liveness ping lists the requests it took since
its previous pong (:class:`~transfer.messages.PeerPong`). So once a pong
arrives for a ping that was sent after a request, a request still not
acknowledged never will be: it was lost, dropped on the way or by the
prefill rank. Its room then fails within a heartbeat or two, not at its
transfer timeout.

The rule needs the request and the ping on one ordered path (one control
socket to the prefill rank's endpoint), the request's send time taken once
it is queued, and the ping's before it is queued.
"""

from __future__ import annotations

from typing import Generic, TypeVar

Owner = TypeVar("Owner")


class UnackedRequests(Generic[Owner]):
    """Requests sent and not yet acknowledged, by prefill session. Not
    thread-safe: the owner calls it under its lock."""

    def __init__(self) -> None:
        # session -> request id -> (sent at, owner, prefill TP rank)
        self._pending: dict[str, dict[int, tuple[float, Owner, int]]] = {}

    def __len__(self) -> int:
        return sum(len(p) for p in self._pending.values())

    def sent(self, session: str, request_id: int, owner: Owner, tp_rank: int, at: float) -> None:
        """Request ``request_id`` of ``owner`` went to prefill rank
        ``tp_rank`` (``session``); ``at``: a monotonic time taken after it
        was queued."""
        self._pending.setdefault(session, {})[request_id] = (at, owner, tp_rank)

    def pending(self, session: str, request_id: int) -> bool:
        """Whether ``request_id`` went to ``session`` and awaits its acknowledgement."""
        return request_id in self._pending.get(session, ())

    def forget(self, session: str, request_id: int) -> None:
        """The request's room ended: nothing more to expect of it."""
        pending = self._pending.get(session)
        if pending is not None:
            pending.pop(request_id, None)
            if not pending:
                del self._pending[session]

    def pong(self, session: str, acks, pinged_at: float | None) -> list[tuple[Owner, int]]:
        """A pong from ``session`` acknowledging ``acks``, answering a ping
        sent at ``pinged_at`` (None: not known, acks only). Returns the lost
        requests' (owner, prefill TP rank), each once: those sent before the
        ping and never acknowledged."""
        pending = self._pending.get(session)
        if not pending:
            return []
        for request_id in acks:
            pending.pop(request_id, None)
        lost = []
        if pinged_at is not None:
            for request_id in [r for r, (at, _, _) in pending.items() if at < pinged_at]:
                _, owner, tp_rank = pending.pop(request_id)
                lost.append((owner, tp_rank))
        if not pending:
            del self._pending[session]
        return lost
