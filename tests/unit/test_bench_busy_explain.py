"""benchmarks.busy_explain: a rank's slices over 1 ms are kept with what the
machine and the thread did during them; shorter ones are not."""

import threading
import time

from benchmarks import busy_explain
from transfer import round_times


def _spin(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_a_long_slice_is_kept_with_the_machines_ticks_and_the_threads_switches(monkeypatch):
    monkeypatch.setattr(round_times.RoundTimes, "round", round_times.RoundTimes.round)  # undone after the test
    monkeypatch.setattr(busy_explain, "_long", [])
    busy_explain.install()
    times = round_times.RoundTimes()
    with times.round("liveness") as r:
        _spin(0.0001)
        r.tick()  # under the slice: no cut
        _spin(0.002)
        r.tick()  # a 2 ms slice ends here
        _spin(0.0001)
        with r.waiting():  # a wait: the slice before it is short, the next begins after it
            _spin(0.003)  # the thread's clock inside a wait is not the round's
        _spin(0.0015)
    with times.round("sweep"):
        _spin(0.0001)
    kept = busy_explain.long_slices()
    assert [row["task"] for row in kept] == ["liveness", "liveness"], kept
    assert kept[0]["cpu_ms"] >= 2.0 and 1.5 <= kept[1]["cpu_ms"] < 2.0, kept
    here = "test_bench_busy_explain.py:"
    assert kept[0]["from"].startswith(here) and kept[0]["to"].startswith(here), kept  # the ticks' call sites
    assert int(kept[0]["from"].split(":")[1]) < int(kept[0]["to"].split(":")[1]) <= int(kept[1]["from"].split(":")[1])
    for row in kept:
        assert row["wall_ms"] > 0 and set(row) == {"task", "cpu_ms", "wall_ms", "held_ms", "steal", "softirq", "irq",
                                                   "voluntary", "involuntary", "minor_faults", "from", "to", "tid",
                                                   "start_s", "end_s"}, row
        assert min(row["steal"], row["softirq"], row["irq"], row["voluntary"], row["involuntary"]) >= 0, row
        # the slice on CLOCK_MONOTONIC, as benchmarks.hold_trace matches it to the kernel's trace
        assert row["tid"] == threading.get_native_id() and row["end_s"] - row["start_s"] >= row["cpu_ms"] / 1e3 / 2, row
        assert row["held_ms"] <= row["cpu_ms"] and row["held_ms"] <= row["wall_ms"] + 0.1, row
    assert times.snapshot()["periodic_max_cpu_s"]["liveness"] >= 0.002  # the round's own measure is unchanged


def test_a_slow_read_of_the_machine_is_no_part_of_the_slice(monkeypatch):
    """The machine's counters are read before a slice's clocks start: a read
    that takes long (/proc/stat on a loaded machine: over 0.1 ms once, which
    made a slice's hold pass its wall-clock span) is neither in the slice's
    CPU time nor outside its span."""
    monkeypatch.setattr(round_times.RoundTimes, "round", round_times.RoundTimes.round)  # undone after the test
    monkeypatch.setattr(busy_explain, "_long", [])
    ticks = busy_explain.machine_ticks

    def slow_ticks():
        _spin(0.002)
        return ticks()

    monkeypatch.setattr(busy_explain, "machine_ticks", slow_ticks)
    busy_explain.install()
    times = round_times.RoundTimes()
    with times.round("sweep") as r:
        _spin(0.0012)
        r.tick()  # a slice ends; the next one's start is read slowly
        _spin(0.0012)
        with r.waiting():
            pass
        _spin(0.0012)
        r.restart()  # what ran since the wait is not the round's: not kept
        _spin(0.0012)
    kept = busy_explain.long_slices()
    assert len(kept) == 3, kept
    for row in kept:
        assert 1.2 <= row["cpu_ms"] < 2.4, row  # not the 2 ms read (it stood before the slice's clocks)
        assert row["held_ms"] <= row["wall_ms"], row


def test_the_machines_ticks_only_grow():
    first = busy_explain.machine_ticks()
    _spin(0.001)
    assert all(b >= a >= 0 for a, b in zip(first, busy_explain.machine_ticks()))
