"""The layer-wise benchmark's model of what streaming can gain (pure)."""

import pytest

from benchmarks.layerwise import GROUPS, best_cut, layer_s


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
