"""Short staging serves the oldest room first, on both sides: decode grants
its waiting StageRequests by the age of their room's receiver, prefill asks
(and takes local regions) by the age of the part's sender; rooms as old go
in the order their parts came. Pure unit tests of the two flows, with a
recording control channel in place of the real one."""

import threading
from types import SimpleNamespace

import numpy as np

from transfer.messages import PagesStaged, StageGrant, StageRequest
from transfer.rooms.staged_decode import DecodeStaging
from transfer.rooms.staged_prefill import PrefillStaging
from transfer.staging.area import StagingArea

UNIT = StagingArea.ALIGN


class Channel:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, endpoint, msg) -> None:
        self.sent.append(msg)


def _ctx(staging_units: int):
    return SimpleNamespace(lock=threading.RLock(), where="test rank", channel=Channel(),
                           staging=SimpleNamespace(area=StagingArea(staging_units * UNIT), fenced=False),
                           rank=SimpleNamespace(tp_rank=0, control_endpoint="tcp://prefill"))


def _ask(room: int, part: int) -> StageRequest:
    return StageRequest(room=room, request_id=room * 10 + 1, prefill_tp_rank=0, prefill_endpoint="tcp://prefill",
                        part=part, nbytes=UNIT)


def _granted(ctx) -> list[tuple[int, int]]:
    return [(m.room, m.part) for m in ctx.channel.sent if isinstance(m, StageGrant)]


def _land(staging: DecodeStaging, ctx, room: int, part: int) -> None:
    """The part granted to ``room`` landed after its room ended: its region is freed."""
    grant = next(m for m in ctx.channel.sent if isinstance(m, StageGrant) and (m.room, m.part) == (room, part))
    staging.on_staged(PagesStaged(room=room, request_id=room * 10 + 1, prefill_tp_rank=0, part=part,
                                  offset=grant.offset, nbytes=UNIT, page_start=0, num_pages=1), None)


def test_decode_grants_the_oldest_rooms_waiting_request_first():
    ctx = _ctx(staging_units=2)
    created = {(1, 11): 5.0, (2, 21): 9.0, (3, 31): 1.0}  # room 3 the oldest, room 2 the newest
    staging = DecodeStaging(ctx, lambda room, rid: created.get((room, rid)), quarantine_s=60.0)
    for part in range(4):
        staging.on_request(_ask(2, part))  # the newest room asks first: two granted, two wait
    staging.on_request(_ask(1, 0))
    staging.on_request(_ask(3, 0))
    staging.on_request(_ask(3, 1))
    assert _granted(ctx) == [(2, 0), (2, 1)]
    assert "2 part request(s) waiting" in staging.describe(3, 31)
    _land(staging, ctx, 2, 0)
    _land(staging, ctx, 2, 1)
    assert _granted(ctx) == [(2, 0), (2, 1), (3, 0), (3, 1)]  # first come would have granted (2, 2), (2, 3)
    del created[(1, 11)]  # room 1 ended while it waited: its request is dropped, not granted
    _land(staging, ctx, 3, 0)
    _land(staging, ctx, 3, 1)
    assert _granted(ctx) == [(2, 0), (2, 1), (3, 0), (3, 1), (2, 2), (2, 3)]
    assert "0 part request(s) waiting" in staging.describe(1, 11)


def test_decode_grants_no_region_with_a_request_while_asks_wait():
    ctx = _ctx(staging_units=4)
    staging = DecodeStaging(ctx, lambda room, rid: 1.0, quarantine_s=60.0)
    for part in range(5):
        staging.on_request(_ask(1, part))
    assert len(_granted(ctx)) == 4
    assert staging.pregrant(2, 21, 0, UNIT) == -1


class Sender:
    def __init__(self, room: int, created: float) -> None:
        self.room, self.created = room, created
        self.terminal = False
        self.where = f"room {room}"
        self.done: list = []

    def on_chunk_done(self, error) -> None:
        self.done.append(error)

    def on_part_landed(self, spec) -> None:
        raise AssertionError("no part lands here")


def _specs(sender: Sender, parts) -> list:
    req = SimpleNamespace(request_id=sender.room * 10 + 1, decode_endpoint="tcp://decode",
                          decode_session="unknown session")
    return [SimpleNamespace(req=req, part=p, granted=None, direct=False, write_bytes=UNIT, region_bytes=UNIT,
                            nbytes=UNIT, src_pages=np.arange(1), describe=lambda p=p: f"staged part {p}")
            for p in parts]


def _asked(ctx) -> list[tuple[int, int]]:
    return [(m.room, m.part) for m in ctx.channel.sent if isinstance(m, StageRequest)]


def test_prefill_asks_for_the_oldest_rooms_parts_first():
    """Asks are capped at the local staging (two regions here): the parts
    beyond wait, and a waiting part of an older room asks before the newer
    room's parts that came before it."""
    ctx = _ctx(staging_units=2)
    staging = PrefillStaging(ctx, peers={})  # no decode peer: a granted part's write fails at once
    new, old = Sender(2, created=9.0), Sender(1, created=5.0)
    staging.submit(new, _specs(new, range(4)))
    staging.submit(old, _specs(old, range(2)))
    assert _asked(ctx) == [(2, 0), (2, 1)]
    staging.on_grant(StageGrant(room=2, request_id=21, part=0, offset=0))
    assert _asked(ctx) == [(2, 0), (2, 1), (1, 0)]  # first come would have asked (2, 2)
    staging.on_grant(StageGrant(room=2, request_id=21, part=1, offset=UNIT))
    staging.on_grant(StageGrant(room=1, request_id=11, part=0, offset=0))
    assert _asked(ctx) == [(2, 0), (2, 1), (1, 0), (1, 1), (2, 2)]
    assert len(new.done) == 2 and len(old.done) == 1
    assert all("unknown session" in str(e) for e in new.done + old.done), new.done + old.done
