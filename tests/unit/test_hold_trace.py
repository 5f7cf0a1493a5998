"""benchmarks.hold_trace: interrupt spans out of ``perf script`` lines, and a
long slice split into the interrupts that ran on its thread and its own time."""

import pytest

from benchmarks.hold_trace import Spans, split

# Two CPUs: on CPU 0 thread 501 takes a softirq with a hard IRQ nested in it
# (one span, not two), later a timer tick; on CPU 1 thread 777 takes a softirq
# of its own. A line that is no event (perf's header) is skipped.
LINES = """\
# ========
   501 [000]   100.000100000:     irq:softirq_entry: vec=3 [action=NET_RX]
   501 [000]   100.000200000: irq:irq_handler_entry: irq=36 name=virtio1-req.0
   501 [000]   100.000250000:  irq:irq_handler_exit: irq=36 ret=handled
   501 [000]   100.000900000:      irq:softirq_exit: vec=3 [action=NET_RX]
   777 [001]   100.000300000:     irq:softirq_entry: vec=1 [action=TIMER]
   777 [001]   100.000400000:      irq:softirq_exit: vec=1 [action=TIMER]
   501 [000]   100.002000000: irq_vectors:local_timer_entry: vector=236
   501 [000]   100.002050000: irq_vectors:local_timer_exit: vector=236
""".splitlines()


def test_nested_interrupts_are_one_span_of_the_outer_kind():
    spans = Spans.parse(LINES)
    assert spans.by_tid[501] == [(100.0001, 100.0009, "softirq:NET_RX"), (100.002, 100.00205, "local_timer")]
    assert spans.by_tid[777] == [(100.0003, 100.0004, "softirq:TIMER")]


def test_a_slice_counts_only_its_own_threads_interrupts_inside_it():
    spans = Spans.parse(LINES)
    total, kinds = spans.inside(501, 100.0005, 100.0030)  # half the softirq, all the tick
    assert total == pytest.approx(0.00045)
    assert kinds == pytest.approx({"softirq:NET_RX": 0.0004, "local_timer": 0.00005})
    assert spans.inside(777, 100.0005, 100.0030) == (0.0, {})  # its softirq ended before
    assert spans.inside(999, 100.0, 101.0) == (0.0, {})


def test_split_takes_the_interrupts_out_of_the_slices_cpu_time():
    row = {"task": "resolver", "cpu_ms": 1.5, "tid": 501, "start_s": 100.0, "end_s": 100.003}
    out = split(row, Spans.parse(LINES))
    assert out["irq_ms"] == pytest.approx(0.85)
    assert out["own_ms"] == pytest.approx(0.65)
    assert out["irq_by_kind_ms"] == {"softirq:NET_RX": 0.8, "local_timer": 0.05}
    assert out["task"] == "resolver"


def test_an_exit_without_its_entry_is_ignored():
    lines = ["   501 [000]   100.000900000:      irq:softirq_exit: vec=3 [action=NET_RX]",
             "   501 [000]   100.001000000:     irq:softirq_entry: vec=3 [action=NET_RX]",
             "   501 [000]   100.001500000:      irq:softirq_exit: vec=3 [action=NET_RX]"]
    assert Spans.parse(lines).by_tid == {501: [(100.001, 100.0015, "softirq:NET_RX")]}


def test_cpu_samples_keep_their_call_chains_and_summarise_by_slice():
    lines = ["   501 [000]   100.001000000: cpu-clock/call-graph=fp,freq=4000/: ",
             "\tffffffff815ffded smp_call_function_many_cond ([kernel.kallsyms])",
             "\tffffffff81600f3d __x64_sys_munmap ([kernel.kallsyms])",
             "\t          1c0610 _PyEval_EvalFrameDefault (/lib/libpython3.11.so.1.0)",
             "",
             "   501 [000]   100.001250000: cpu-clock/call-graph=fp,freq=4000/: ",
             "\t          1c0610 _PyEval_EvalFrameDefault (/lib/libpython3.11.so.1.0)",
             "",
             "   501 [000]   100.001300000:     irq:softirq_entry: vec=3 [action=NET_RX]",
             "\tffffffff815ffded net_rx_action ([kernel.kallsyms])",  # a tracepoint's chain is no sample
             "   501 [000]   100.001400000:      irq:softirq_exit: vec=3 [action=NET_RX]",
             "   501 [000]   100.009000000: cpu-clock/call-graph=fp,freq=4000/: ",
             "\t          1c0610 gc_collect_main (/lib/libpython3.11.so.1.0)"]
    spans = Spans.parse(lines)
    assert [t for t, _ in spans.samples[501]] == [100.001, 100.00125, 100.009]
    assert spans.samples[501][0][1] == ["smp_call_function_many_cond [k]", "__x64_sys_munmap [k]",
                                        "_PyEval_EvalFrameDefault"]
    assert spans.by_tid[501] == [(100.0013, 100.0014, "softirq:NET_RX")]
    assert spans.sampled(501, 100.0, 100.002) == {
        "samples": 2, "in_kernel": 1, "syscalls": {"__x64_sys_munmap [k]": 1},
        "leaves": {"smp_call_function_many_cond [k]": 1, "_PyEval_EvalFrameDefault": 1}}
    assert spans.sampled(777, 100.0, 101.0)["samples"] == 0
