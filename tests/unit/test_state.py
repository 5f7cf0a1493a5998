"""transfer.state.RoomState: the transition table over KVPoll."""

from __future__ import annotations

import itertools

import pytest

from transfer.errors import KVFerryError, StateError
from transfer.state import TERMINAL, KVPoll, RoomState

LEGAL = {
    (KVPoll.Bootstrapping, KVPoll.WaitingForInput),
    (KVPoll.WaitingForInput, KVPoll.Transferring),
    (KVPoll.Transferring, KVPoll.Success),
}
NON_TERMINAL = [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring]


def _at(state: KVPoll, where: str = "room 7 (prefill tp 0)") -> RoomState:
    """A RoomState driven to ``state`` through legal moves (or fail())."""
    rs = RoomState(where)
    if state is KVPoll.Failed:
        rs.fail(RuntimeError("setup"))
        return rs
    path = [KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success]
    for s in path[: [KVPoll.Bootstrapping, *path].index(state)]:
        rs.move(s)
    assert rs.state is state
    return rs


def test_initial_state():
    rs = RoomState("here")
    assert rs.state is KVPoll.Bootstrapping
    assert rs.error is None and not rs.terminal and rs.where == "here"


def test_full_forward_path():
    rs = RoomState("r")
    for to in (KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success):
        rs.move(to)
        assert rs.state is to
    assert rs.terminal and rs.error is None


@pytest.mark.parametrize("src, dst", sorted(LEGAL))
def test_legal_transitions(src, dst):
    rs = _at(src)
    rs.move(dst)
    assert rs.state is dst


ILLEGAL = [(a, b) for a, b in itertools.product(KVPoll, KVPoll)
           if (a, b) not in LEGAL and b is not KVPoll.Failed]


@pytest.mark.parametrize("src, dst", ILLEGAL)
def test_illegal_transitions_raise_and_change_nothing(src, dst):
    rs = _at(src, where="room 42 (decode tp 1)")
    before_error = rs.error
    with pytest.raises(StateError) as ei:
        rs.move(dst)
    assert isinstance(ei.value, KVFerryError)
    assert "room 42 (decode tp 1)" in str(ei.value)
    assert src.name in str(ei.value) and dst.name in str(ei.value)
    assert rs.state is src and rs.error is before_error


def test_illegal_count():
    # 5 x 5 pairs, minus 3 legal ones, minus the 5 moves to Failed (tested apart)
    assert len(ILLEGAL) == 25 - 3 - 5


@pytest.mark.parametrize("src", list(KVPoll))
def test_move_to_failed_is_refused(src):
    rs = _at(src)
    with pytest.raises(StateError, match="fail()"):
        rs.move(KVPoll.Failed)
    assert rs.state is src


@pytest.mark.parametrize("src", NON_TERMINAL)
def test_fail_from_non_terminal(src):
    rs = _at(src)
    first, second = RuntimeError("first"), RuntimeError("second")
    assert rs.fail(first) is True
    assert rs.state is KVPoll.Failed and rs.terminal
    assert rs.error is first
    assert rs.fail(second) is False
    assert rs.error is first and rs.state is KVPoll.Failed
    with pytest.raises(StateError):
        rs.move(KVPoll.Success)


def test_fail_on_success_changes_nothing():
    rs = _at(KVPoll.Success)
    assert rs.fail(RuntimeError("late")) is False
    assert rs.state is KVPoll.Success and rs.error is None


def test_fail_on_failed_changes_nothing():
    rs = RoomState("r")
    err = ValueError("x")
    rs.fail(err)
    assert rs.fail(KeyError("y")) is False
    assert rs.error is err


def test_terminal_set_and_values():
    assert TERMINAL == {KVPoll.Success, KVPoll.Failed}
    assert KVPoll.Failed == 0 and int(KVPoll.Failed) == 0
    assert min(KVPoll) is KVPoll.Failed
    assert all(KVPoll.Failed < s for s in KVPoll if s is not KVPoll.Failed)
    # a MIN reduction over ranks' states fails them all if any failed
    assert min([KVPoll.Success, KVPoll.Transferring, KVPoll.Failed]) is KVPoll.Failed
    assert [s.value for s in KVPoll] == [0, 1, 2, 3, 4]
    assert KVPoll.Success == 4 and KVPoll.Bootstrapping == 1


def test_on_change_is_called_for_every_change_and_only_then():
    calls = []
    st = RoomState("room 1", on_change=lambda: calls.append(st.state))
    st.move(KVPoll.WaitingForInput)
    st.move(KVPoll.Transferring)
    assert st.fail(RuntimeError("boom")) is True
    assert st.fail(RuntimeError("again")) is False  # terminal: no change, no call
    with pytest.raises(StateError):
        st.move(KVPoll.Success)
    assert calls == [KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Failed]
