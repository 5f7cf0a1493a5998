"""transfer.rooms.request_acks: a request sent before a ping whose pong does
not acknowledge it is lost, once; every other request never is."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from transfer.rooms.request_acks import UnackedRequests


def test_lost_only_when_a_later_ping_was_answered_without_it():
    book = UnackedRequests()
    book.sent("p0", 11, "room-a", 0, at=1.0)
    book.sent("p0", 12, "room-b", 0, at=3.0)
    assert book.pong("p0", acks=(), pinged_at=0.5) == []  # the ping went before both requests
    assert book.pong("p0", acks=(), pinged_at=None) == []  # a pong to an unknown ping tells nothing
    assert book.pong("p0", acks=(12,), pinged_at=2.0) == [("room-a", 0)]
    assert book.pong("p0", acks=(), pinged_at=9.0) == []  # each reported once; room-b was acknowledged
    assert len(book) == 0


def test_an_ended_room_is_forgotten_and_other_sessions_are_apart():
    book = UnackedRequests()
    book.sent("p0", 1, "a", 0, at=1.0)
    book.sent("p1", 1, "a", 1, at=1.0)
    book.forget("p0", 1)
    assert book.pong("p0", acks=(), pinged_at=5.0) == []
    assert book.pong("p1", acks=(), pinged_at=5.0) == [("a", 1)]


@given(st.lists(st.tuples(st.floats(0, 10), st.booleans()), max_size=30), st.floats(0, 10))
def test_exactly_the_unacknowledged_requests_sent_before_the_ping_are_lost(requests, pinged_at):
    book = UnackedRequests()
    for rid, (at, _) in enumerate(requests):
        book.sent("p", rid, rid, 0, at=at)
    acks = [rid for rid, (_, acked) in enumerate(requests) if acked]
    lost = sorted(owner for owner, _ in book.pong("p", acks, pinged_at))
    assert lost == [rid for rid, (at, acked) in enumerate(requests) if not acked and at < pinged_at]
    assert len(book) == sum(1 for at, acked in requests if not acked and at >= pinged_at)
