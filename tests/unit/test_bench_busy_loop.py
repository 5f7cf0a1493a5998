"""benchmarks.busy_loop's record of the loop's slowest iterations."""

import os
import time

from benchmarks.busy_loop import SlowSteps, ThreadClock
from benchmarks.steal import TICK_MS, StealWatch, read_steal
from harness.busywork import python_work


def test_the_slowest_iterations_are_kept_with_their_parts_and_when():
    steps = SlowSteps()
    t0 = steps._t0
    for i, (take, poll) in enumerate([(0.001, 0.002), (0.0, 0.105), (0.003, 0.0), (0.0, 0.001), (0.002, 0.002),
                                      (0.0, 0.0), (0.004, 0.020), (0.0, 0.0005)]):
        start = t0 + i
        steps.add(start, ("take", start + take), ("open", start + take), ("step", start + take + 0.010),
                  ("poll", start + take + 0.010 + poll))
    rows = steps.slowest()
    assert [r["ms"] for r in rows] == [115.0, 34.0, 14.0, 13.0, 13.0]
    assert rows[0] == {"ms": 115.0, "at_s": 1.0, "take": 0.0, "open": 0.0, "step": 10.0, "poll": 105.0}
    assert rows[1]["at_s"] == 6.0 and rows[1]["take"] == 4.0 and rows[1]["poll"] == 20.0
    for r in rows:
        assert abs(r["take"] + r["open"] + r["step"] + r["poll"] - r["ms"]) < 0.05


def test_an_iteration_keeps_the_ms_of_the_calls_inside_it():
    steps = SlowSteps()
    start = steps._t0
    steps.add(start, ("take", start), ("open", start), ("step", start + 0.01), ("poll", start + 0.112),
              calls={"prefill_kv_poll": 1.234, "prefill_kv_send": 100.456})
    (row,) = steps.slowest()
    assert row["poll"] == 102.0 and row["prefill_kv_send"] == 100.46 and row["prefill_kv_poll"] == 1.23


def test_an_iteration_says_where_its_time_went_by_the_threads_clock():
    steps = SlowSteps()
    start = steps._t0
    # 112 ms: 12 on a CPU, 0.5 waiting for one, none given up: the host took the vCPU for the rest
    steps.add(start, ("take", start), ("open", start), ("step", start + 0.110), ("poll", start + 0.112),
              clock=((1.000, 2.0000, 7, 3), (1.012, 2.0005, 7, 4)))
    (row,) = steps.slowest()
    assert row["cpu"] == 12.0 and row["runq"] == 0.5 and row["unseen"] == 99.5
    assert row["voluntary"] == 0 and row["involuntary"] == 1


def test_the_threads_clock_counts_its_own_cpu_and_switches():
    clock = ThreadClock()
    try:
        before = clock.read()
        python_work(0.02)
        time.sleep(0.02)
        after = clock.read()
    finally:
        clock.close()
    cpu, runq = after[0] - before[0], after[1] - before[1]
    assert 0.01 <= cpu < 0.2, cpu
    assert runq >= 0.0
    assert after[2] > before[2]  # the sleep gave the CPU up


def test_the_steal_watch_lays_steal_beside_a_window(tmp_path):
    stat = tmp_path / "stat"

    def write(steal1: int) -> None:
        lines = [f"cpu  10 0 10 100 0 0 0 {steal1} 0 0",
                 "cpu0 5 0 5 50 0 0 0 0 0 0", f"cpu1 5 0 5 50 0 0 0 {steal1} 0 0", "intr 1 2 3"]
        (tmp_path / "next").write_text("\n".join(lines) + "\n")
        os.replace(tmp_path / "next", stat)

    write(4)
    assert read_steal(str(stat)) == [0, 4]
    with StealWatch(interval_s=0.005, path=str(stat)) as watch:
        time.sleep(0.05)
        before = time.time()
        write(7)
        time.sleep(0.05)
        after = time.time()
        time.sleep(0.05)
    assert watch.total_ms() == 3 * TICK_MS
    assert watch.within(before, after) == 3 * TICK_MS
    assert watch.within(after + 0.03, after + 0.04) == 0.0
    assert watch.within(before - 1.0, before - 0.5) == 0.0
