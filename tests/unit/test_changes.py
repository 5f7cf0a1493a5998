"""The change log (transfer.changes) and KVManager.changed_rooms over
loopback rooms: which rooms changed, without polling them all."""

import gc
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import KVPoll, KVReceiver, KVSender, Role
from transfer.changes import ChangeLog

from ._rooms import assert_landed, random_pages, run_room, wait_until


class Room:
    def __init__(self, n: int) -> None:
        self.n = n


def test_each_consumer_reads_from_its_own_mark():
    log, rooms = ChangeLog(8), [Room(i) for i in range(4)]
    a = b = log.progress
    log.record(rooms[0], 1)
    log.record(rooms[1], 2)
    a, changes = log.since(a)
    assert a == 2 and [(r.n, s) for r, s in changes] == [(0, 1), (1, 2)]
    log.record(rooms[2], 3)
    a, changes = log.since(a)
    assert a == 3 and [(r.n, s) for r, s in changes] == [(2, 3)]
    b, changes = log.since(b)  # the slower consumer still sees all three
    assert b == 3 and [r.n for r, _ in changes] == [0, 1, 2]
    assert log.since(b) == (3, [])


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 16), num_changes=st.integers(0, 60), mark=st.integers(0, 60))
def test_a_consumer_that_fell_behind_is_told_to_poll_everything(capacity, num_changes, mark):
    log, rooms = ChangeLog(capacity), [Room(i) for i in range(num_changes)]
    for i, r in enumerate(rooms):
        log.record(r, i)
    mark = min(mark, num_changes)
    progress, changes = log.since(mark)
    assert progress == num_changes
    if num_changes - mark > capacity:
        assert changes is None
    else:
        assert [(r.n, s) for r, s in changes] == [(i, i) for i in range(mark, num_changes)]


def test_a_change_that_names_no_room_makes_consumers_poll_everything():
    log, room = ChangeLog(8), Room(0)
    log.record(room, 1)
    log.record(None, None)
    log.record(room, 2)
    assert log.since(0) == (3, None)
    assert log.since(2)[1] == [(room, 2)]


def test_the_log_keeps_no_room_alive_and_skips_dropped_ones():
    log, kept = ChangeLog(8), Room(1)
    log.record(Room(0), 1)
    log.record(kept, 2)
    gc.collect()
    assert log.since(0) == (2, [(kept, 2)])


def _tracked_held_by(log: ChangeLog) -> int:
    """The objects a garbage collection walks on the log's account: those the
    collector tracks that the log reaches through its own fields (types,
    modules and the rooms behind weak references are not the log's)."""
    seen, stack, count = set(), [getattr(log, name) for name in ChangeLog.__slots__], 1
    while stack:
        obj = stack.pop()
        if id(obj) in seen or not gc.is_tracked(obj) or isinstance(obj, type):
            continue
        seen.add(id(obj))
        count += 1
        stack.extend(gc.get_referents(obj))
    return count


def test_a_ring_of_dropped_rooms_leaves_nothing_for_a_collection_to_walk():
    """The ring holds numbers: rooms that came and went leave no objects the
    garbage collector tracks (a ring of weak references would leave one per
    entry), and the live room's changes still read back. Counted on what the
    log holds, not on the whole process (other tests' threads allocate too)."""
    log = ChangeLog(4096)
    empty = _tracked_held_by(log)
    for i in range(4096):
        log.record(Room(i), i % 5)
    kept = Room(-1)
    log.record(kept, 7)
    log.record(kept, 8)
    held = _tracked_held_by(log)
    assert held - empty <= 4, f"the log holds {held} tracked objects after 4096 dropped rooms ({empty} empty)"
    assert log.since(log.progress - 3) == (log.progress, [(kept, 7), (kept, 8)])


def test_the_count_of_tracked_objects_sees_a_ring_of_references():
    """The measure above can fail: a ring that held its rooms' weak
    references would count one object per entry."""
    log = ChangeLog(64)
    empty = _tracked_held_by(log)
    rooms = [Room(i) for i in range(64)]
    log._states[:] = [weakref.ref(r) for r in rooms]  # what the old ring held
    assert _tracked_held_by(log) - empty >= 64


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from("new drop change read".split()), st.integers(0, 7)), max_size=80))
def test_rooms_that_come_and_go_read_back_as_a_model_says(ops):
    """Rooms created, changed and dropped in any order (a dropped room's id
    may come back as a new room's): every read names exactly the live rooms'
    changes since the mark, each with its own state."""
    log, live, mark, names, changes = ChangeLog(64), {}, 0, 0, []  # capacity 64: up to 80 changes may fall behind
    for op, n in ops:
        if op == "new" or (op == "change" and not live):
            names += 1
            live[names] = Room(names)
            log.record(live[names], (names, 0))
            changes.append((names, (names, 0)))
        elif op == "drop" and live:
            del live[sorted(live)[n % len(live)]]
        elif op == "change" and live:
            name = sorted(live)[n % len(live)]
            log.record(live[name], (name, n))
            changes.append((name, (name, n)))
        elif op == "read":
            mark, got = log.since(mark)
            if got is None:
                assert len(changes) > 64
            else:
                assert [(r.n, s) for r, s in got] == [(k, s) for k, s in changes if k in live]
            changes = got = []  # the read's rooms, let go


def test_marks_from_elsewhere_are_refused():
    with pytest.raises(ValueError, match="outside this log"):
        ChangeLog(4).since(5)
    with pytest.raises(ValueError, match="capacity"):
        ChangeLog(0)


def test_changed_rooms_names_exactly_the_rooms_that_moved(cluster):  # noqa: F811
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(3)
    idle = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 99)  # never init()ed: stays WaitingForInput
    wait_until(decode.mgr, lambda: idle.poll() is KVPoll.WaitingForInput, what="idle room bootstrapped")
    p_mark, d_mark = prefill.mgr.progress, decode.mgr.progress
    src, dst = random_pages(rng, 9), random_pages(rng, 9)
    sender, receiver = run_room(prefill, decode, 5, src, dst)
    assert_landed(prefill, decode, src, dst)
    d_mark, changes = decode.mgr.changed_rooms(d_mark)
    assert d_mark == decode.mgr.progress
    assert [s for r, s in changes if r is receiver] == [KVPoll.WaitingForInput, KVPoll.Transferring,
                                                         KVPoll.Success]
    assert all(r is receiver for r, _ in changes), "a room that did not move was reported"
    p_mark, changes = prefill.mgr.changed_rooms(p_mark)
    assert [(r, s) for r, s in changes] == [(sender, KVPoll.WaitingForInput), (sender, KVPoll.Transferring),
                                            (sender, KVPoll.Success)]


def test_a_timeout_reaches_changed_rooms_without_any_poll(cluster):  # noqa: F811
    prefill = cluster.rank(Role.PREFILL, bootstrap_timeout_s=0.5)
    mark = prefill.mgr.progress
    sender = KVSender(prefill.mgr, None, 7)  # no decode rank ever asks for it
    # Only the manager's own sweep polls the room: the test never calls poll().
    wait_until(prefill.mgr, lambda: prefill.mgr.changed_rooms(mark)[1], timeout_s=5, what="bootstrap timeout")
    _, changes = prefill.mgr.changed_rooms(mark)
    assert changes == [(sender, KVPoll.Failed)]
    with pytest.raises(Exception, match="decode request"):
        sender.failure_exception()
