"""The decode phase table: legal moves, what poll() reports, Failed wins."""

import pytest

from transfer.errors import StateError
from transfer.rooms.decode_phases import ENDING, LIVE, POLL, TERMINAL, DecodePhase as P, DecodePhases
from transfer.state import KVPoll


def _through(*phases) -> DecodePhases:
    ph = DecodePhases("room 1")
    for p in phases:
        ph.move(p)
    return ph


def test_the_phases_partition():
    assert LIVE | ENDING | TERMINAL == set(P) and not (LIVE & ENDING or LIVE & TERMINAL or ENDING & TERMINAL)


def test_a_normal_room_reports_the_state_table_in_order():
    seen = []
    ph = DecodePhases("room 1", on_change=lambda: seen.append(ph.poll))
    for p in (P.WAITING_FOR_INPUT, P.PREFETCHING, P.TRANSFERRING, P.SUCCESS):
        ph.move(p)
        assert ph.poll is POLL[p]
    assert seen == [KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success]


def test_drain_then_restore_reports_transferring_then_success():
    ph = _through(P.WAITING_FOR_INPUT, P.TRANSFERRING, P.DRAINING)
    assert ph.poll is KVPoll.Transferring
    ph.move(P.RESTORING)
    assert ph.poll is KVPoll.Transferring
    ph.move(P.SUCCESS)
    assert ph.poll is KVPoll.Success


def test_a_restore_keeps_what_poll_said_and_then_goes_forward():
    ph = _through(P.RESTORING)  # failed while bootstrapping, init() given
    assert ph.poll is KVPoll.Bootstrapping
    ph.move(P.SUCCESS)
    assert ph.poll is KVPoll.Success


@pytest.mark.parametrize("path,bad", [((), P.TRANSFERRING), ((), P.DRAINING), ((P.WAITING_FOR_INPUT,), P.SUCCESS),
                                      ((P.WAITING_FOR_INPUT, P.TRANSFERRING, P.DRAINING), P.SUCCESS),
                                      ((P.WAITING_FOR_INPUT, P.TRANSFERRING, P.SUCCESS), P.RESTORING)])
def test_illegal_moves_raise(path, bad):
    ph = _through(*path)
    with pytest.raises(StateError, match=f"to {bad.value}"):
        ph.move(bad)
    assert ph.phase is (path[-1] if path else P.BOOTSTRAPPING)


def test_failed_wins_once_and_only_over_non_terminal_phases():
    ph = _through(P.WAITING_FOR_INPUT, P.TRANSFERRING, P.DRAINING)
    first = ValueError("first")
    assert ph.fail(first) and ph.phase is P.FAILED and ph.poll is KVPoll.Failed and ph.error is first
    assert not ph.fail(ValueError("second")) and ph.error is first
    done = _through(P.WAITING_FOR_INPUT, P.TRANSFERRING, P.SUCCESS)
    assert not done.fail(ValueError("late")) and done.poll is KVPoll.Success
    with pytest.raises(StateError):
        done.move(P.FAILED)
