"""transfer.rooms.early_messages: messages for rooms whose sender does not
exist yet, bounded by rooms and by messages per room; what the bounds or the
timeout drop is returned, never lost silently."""

from transfer.messages import RoomAbort, TransferRequest
from transfer.rooms.early_messages import EarlyMessages


def request(room: int, request_id: int = 1, tp_rank: int = 0) -> TransferRequest:
    return TransferRequest(room=room, request_id=request_id, decode_session=f"s{tp_rank}",
                           decode_endpoint="tcp://127.0.0.1:1", decode_tp_rank=tp_rank, dst_pages=b"",
                           dst_aux_index=-1, assignments=(), num_requests=1)


def test_the_oldest_rooms_go_first_when_the_rooms_are_full_and_each_drop_says_why():
    early = EarlyMessages(max_rooms=2, max_per_room=2)
    assert early.keep(request(1), now=1.0, horizon=0.0) == []
    assert early.keep(request(2), now=2.0, horizon=0.0) == []
    dropped = early.keep(request(3), now=3.0, horizon=0.0)
    assert [d.messages[0].room for d in dropped] == [1] and "more than 2 rooms" in dropped[0].why
    assert len(early) == 2 and early.requests(2) == [request(2)]


def test_stale_rooms_go_before_the_oldest():
    early = EarlyMessages(max_rooms=2, max_per_room=2)
    early.keep(request(1), now=10.0, horizon=0.0)
    early.keep(request(2), now=1.0, horizon=0.0)  # arrived long ago
    dropped = early.keep(request(3), now=11.0, horizon=5.0)
    assert [d.messages[0].room for d in dropped] == [2] and "bootstrap timeout" in dropped[0].why


def test_a_full_room_drops_the_new_message():
    early = EarlyMessages(max_rooms=4, max_per_room=1)
    early.keep(request(1, tp_rank=0), now=1.0, horizon=0.0)
    dropped = early.keep(request(1, tp_rank=1), now=1.0, horizon=0.0)
    assert dropped[0].messages == (request(1, tp_rank=1),) and "more than 1 messages" in dropped[0].why


def test_a_room_whose_only_request_an_abort_withdrew_is_gone_and_the_bounds_still_hold():
    """An abort withdraws a room's only request: the room is not kept empty
    (a full table's next keep once read an empty room's newest message)."""
    early = EarlyMessages(max_rooms=2, max_per_room=4)
    early.keep(request(1, request_id=7), now=1.0, horizon=0.0)
    early.keep(request(2), now=2.0, horizon=0.0)
    assert early.withdraw(1, 7) == [request(1, request_id=7)]
    assert len(early) == 1 and early.requests(1) == []
    assert early.keep(RoomAbort(room=1, request_id=7, reason="gone"), now=3.0, horizon=0.0) == []
    dropped = early.keep(request(3), now=4.0, horizon=0.0)
    assert [d.messages[0].room for d in dropped] == [2]


def test_take_hands_over_the_fresh_and_drops_the_stale():
    early = EarlyMessages(max_rooms=4, max_per_room=4)
    early.keep(request(5, tp_rank=0), now=1.0, horizon=0.0)
    early.keep(request(5, tp_rank=1), now=9.0, horizon=0.0)
    fresh, stale = early.take(5, horizon=5.0)
    assert fresh == [request(5, tp_rank=1)] and stale.messages == (request(5, tp_rank=0),)
    assert len(early) == 0 and early.from_rank(request(5)) is None
