"""The liveness table: pings on schedule, a silent peer lost once, no blacklist."""

import pytest

from transfer.liveness import Liveness


def test_pings_every_interval_and_loses_a_silent_peer_once():
    lv = Liveness(interval_s=1.0, timeout_s=4.0)
    watched = {"a": "tcp://a", "b": "tcp://b"}
    ping, lost = lv.step(watched, now=0.0)
    assert sorted(ping) == [("a", "tcp://a"), ("b", "tcp://b")] and lost == []
    assert lv.step(watched, now=0.5) == ([], [])  # not due yet
    for t in (1.0, 2.0, 3.0, 4.0):
        lv.heard("b", t)
        ping, lost = lv.step(watched, now=t)
        assert sorted(s for s, _ in ping) == ["a", "b"] and lost == []
    ping, lost = lv.step(watched, now=4.01)
    assert lost == ["a"]
    lv.heard("b", 4.5)
    ping, lost = lv.step(watched, now=5.0)
    # still watched (its rooms not failed yet): tracked afresh, not reported twice in a row
    assert lost == [] and sorted(s for s, _ in ping) == ["a", "b"]
    assert lv.silent_for("a", 5.0) == 0.0 and lv.silent_for("b", 5.0) == 0.5


def _steps(lv, watched, times, **kw):
    """Step at each of ``times``; the sessions lost, in order."""
    return [session for t in times for session in lv.step(watched, now=t, **kw)[1]]


def test_a_lost_peer_watched_again_gets_full_grace():
    lv = Liveness(interval_s=1.0, timeout_s=4.0)
    a = {"a": "tcp://a"}
    assert _steps(lv, a, [i * 0.5 for i in range(9)]) == []  # 0 .. 4.0: silent 4 s, not more
    assert lv.step(a, now=4.5)[1] == ["a"]
    # ...and watched again (it came back, or a new room names it): fresh grace, pinged at once
    ping, lost = lv.step(a, now=5.0)
    assert ping == [("a", "tcp://a")] and lost == []
    assert _steps(lv, a, [5.5, 6.0, 6.5, 7.0, 7.5, 8.0, 8.5, 8.9]) == []
    assert lv.step(a, now=9.1)[1] == ["a"]


def test_a_pause_of_the_watcher_is_no_peers_silence():
    """The watcher does not run for 10 s (its process stopped or starved, its
    host paused): only ``interval_s`` of that counts, so both peers are pinged
    at once, not lost; one that answers stays, one that stays silent is lost
    once watched for ``timeout_s`` in all."""
    lv = Liveness(interval_s=1.0, timeout_s=4.0)
    watched = {"a": "tcp://a", "b": "tcp://b"}
    assert _steps(lv, watched, [0.0, 0.5, 1.0]) == []
    ping, lost = lv.step(watched, now=11.0)
    assert lost == [] and sorted(s for s, _ in ping) == ["a", "b"]
    assert lv.last_pause_s == 9.0 and lv.silent_for("b", 11.0) == 2.0  # 1 s before the pause, 1 s of it
    lv.heard("a", 11.2)
    assert _steps(lv, watched, [11.5, 12.0, 12.5, 13.0]) == []
    assert lv.step(watched, now=13.5)[1] == ["b"]
    assert lv.silent_for("a", 13.5) == pytest.approx(2.3)
    # a step late by no more than interval_s is no pause: nothing credited
    assert lv.step(watched, now=14.5)[1] == [] and lv.last_pause_s == 0.0


def test_unwatched_peers_are_forgotten():
    lv = Liveness(interval_s=1.0, timeout_s=4.0)
    lv.step({"a": "tcp://a"}, now=0.0)
    lv.step({}, now=1.0)  # the room ended
    assert lv.step({"a": "tcp://a"}, now=4.5) == ([("a", "tcp://a")], [])


def test_heard_from_unknown_peer_is_ignored():
    lv = Liveness(interval_s=1.0, timeout_s=4.0)
    lv.heard("x", 1.0)
    assert lv.step({}, now=2.0) == ([], [])


@pytest.mark.parametrize("interval,timeout", [(0, 1), (2, 1), (1, 1)])
def test_rejects_bad_settings(interval, timeout):
    with pytest.raises(ValueError):
        Liveness(interval, timeout)


def test_a_gone_peer_is_lost_after_one_interval_of_silence():
    """Gone (its address refuses connections): lost once silent for ``interval_s``, not ``timeout_s``."""
    lv = Liveness(interval_s=1.0, timeout_s=4.0)
    watched = {"a": "tcp://a", "b": "tcp://b"}
    assert _steps(lv, watched, [0.0, 0.5, 1.0, 1.5, 2.0]) == []
    lv.heard("a", 2.0)
    assert lv.step(watched, now=2.5, gone={"a", "b"})[1] == ["b"]  # b silent 2.5 s, a only 0.5 s
    assert lv.step(watched, now=3.1, gone={"a"})[1] == ["a"]
    assert lv.step({"c": "tcp://c"}, now=3.2)[1] == []  # nobody else is lost for it


def test_the_loopback_fabric_shows_links_as_a_network_would():
    from transfer.control.base import ChannelOptions, Link
    from transfer.transport.loopback import LoopbackFabric

    fabric = LoopbackFabric()
    a, b = (fabric.channel(ChannelOptions(host="127.0.0.1"), lambda msg, origin: None) for _ in range(2))
    try:
        assert a.link("loopback://127.0.0.1/999") is Link.UNKNOWN
        assert a.link(b.endpoint) is Link.UP
        fabric.cut(b.endpoint)
        assert a.link(b.endpoint) is Link.DOWN
        fabric.mend(b.endpoint)
        fabric.hold(b.endpoint)
        assert a.link(b.endpoint) is Link.DOWN
        fabric.release(b.endpoint)
        assert a.link(b.endpoint) is Link.UP
        b.close()
        assert a.link(b.endpoint) is Link.GONE
    finally:
        a.close()
        b.close()
