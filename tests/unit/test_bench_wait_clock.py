"""benchmarks.wait_clock: each wait is measured on both clocks, and a wait
that slept was scheduled back in at least once."""

import pytest

from benchmarks import wait_clock


def test_each_wait_is_measured_and_a_thread_that_waited_was_scheduled_back_in():
    report = wait_clock.run("none", 20, busy_thread=False)
    assert report["waits"] == 20 and len(report["longest"]) == 5, report
    assert report["wall_ms_p50"] >= wait_clock.WAIT_S * 1e3, report  # the event is never set: each wait times out
    assert 0 <= report["cpu_ms_p50"] <= report["cpu_ms_p99"] <= report["cpu_ms_max"], report
    for row in report["longest"]:
        assert row["scheduled_in"] >= 1 and row["on_cpu_ms"] > 0 and row["wall_ms"] >= row["cpu_ms"], row


def test_an_unknown_load_is_refused_by_name():
    with pytest.raises(SystemExit, match="unknown load 'disk'"):
        wait_clock.run("disk", 1, busy_thread=False)
