"""The layer-wise benchmark's model of what streaming can gain (pure)."""

import pytest

from benchmarks.layerwise import GROUPS, best_cut, layer_s, merge_runs, table


def test_a_link_faster_than_the_forward_leaves_only_the_last_group_exposed():
    # 100 ms of transfer under a 300 ms forward: everything but the last of 8 groups hides behind compute
    assert best_cut(100.0, 300.0) == pytest.approx(1 - 1 / GROUPS)


def test_a_link_slower_than_the_forward_exposes_what_it_cannot_move_during_it():
    # 500 ms of transfer, 300 ms of forward: 200 ms are exposed however the room is streamed
    assert best_cut(500.0, 300.0) == pytest.approx(0.6)
    assert best_cut(1000.0, 300.0) == pytest.approx(0.3)
    assert best_cut(0.0, 300.0) == 0.0


def test_the_modelled_forward_grows_with_the_batch_and_quadratically_with_the_prompt():
    one = layer_s("llama8b", 1024)
    assert layer_s("llama8b", 1024, 8) == pytest.approx(8 * one)
    # attention's n^2 term makes 8x the tokens cost more than 8x the time
    assert layer_s("llama8b", 8192) > 8 * one


def _row(mode: str, p50: float, slowest: float) -> dict:
    return {"model": "llama8b", "tokens": 8192, "concurrency": 8, "mode": mode, "transport": "mooncake",
            "fence": True, "sched": "busy", "handover": "due", "forward_ms": 2000.0, "exposed_p50_ms": p50,
            "exposed_max_ms": slowest, "ttft_ms": 2000.0 + p50, "load": 2.0}


def test_repeated_runs_of_a_cell_report_their_medians_and_keep_each_runs_p50():
    whole = merge_runs([_row("whole", 900.0, 1500.0), _row("whole", 1200.0, 1900.0), _row("whole", 1000.0, 1600.0)])
    lw = merge_runs([_row("layerwise", 100.0, 700.0), _row("layerwise", 600.0, 1000.0),
                     _row("layerwise", 300.0, 800.0)])
    assert (whole["exposed_p50_ms"], whole["exposed_max_ms"], whole["ttft_ms"]) == (1000.0, 1600.0, 3000.0)
    assert lw["run_p50_ms"] == [100.0, 600.0, 300.0]
    line = table([whole, lw])[2]
    # p50 cut 1 - 300 / 1000, the batch's 1 - 800 / 1600
    assert "| 1000.0 | 300.0 | 70% | 1600.0 | 800.0 | 50% |" in line, line
