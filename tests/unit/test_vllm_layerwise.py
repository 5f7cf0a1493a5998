"""The vLLM connector's layer-wise bookkeeping (transfer.adapters.vllm.layerwise): pure."""

import pytest

from transfer.adapters.vllm.layerwise import LayerStream, layer_groups


def test_target_layers_split_into_contiguous_groups_and_a_draft_is_one_more():
    assert layer_groups(32, 0, 4) == (range(0, 8), range(8, 16), range(16, 24), range(24, 32))
    assert layer_groups(5, 0, 2) == (range(0, 2), range(2, 5))
    assert layer_groups(3, 0, 8) == (range(0, 1), range(1, 2), range(2, 3))  # at most a group per layer
    assert layer_groups(4, 1, 2) == (range(0, 2), range(2, 4), range(4, 5))
    with pytest.raises(ValueError):
        layer_groups(0, 0, 2)


def test_a_group_is_claimed_once_when_its_every_layer_finished_in_any_order():
    s = LayerStream(layer_groups(6, 1, 3))
    s.finish(1)
    assert s.claim(in_forward=True) == []
    s.finish(0)
    assert s.claim(in_forward=True) == [range(0, 2)]
    assert s.claim(in_forward=True) == []  # claimed: never twice
    s.finish(5)
    s.finish(4)
    s.finish(3)
    assert s.claim(in_forward=True) == [range(4, 6)]
    assert not s.done
    s.finish_all()  # the request finished: the rest, the draft's group too
    assert s.claim(in_forward=False) == [range(2, 4), range(6, 7)]
    assert s.done and s.in_forward == 2
