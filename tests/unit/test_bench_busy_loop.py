"""benchmarks.busy_loop's record of the loop's slowest iterations."""

from benchmarks.busy_loop import SlowSteps


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
