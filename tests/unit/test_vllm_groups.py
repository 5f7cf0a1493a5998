"""vLLM's KV-cache groups as kvferry pools (transfer.adapters.vllm.groups):
which group carries the pages, which become state pools, the window's freed
blocks as -1, and the refusals. Pure: vLLM's specs stand in by class name."""

import pytest

from transfer.adapters.vllm.groups import NULL_BLOCK, plan_groups, split_draft
from transfer.pools import unique_regions


class FullAttentionSpec:
    def __init__(self, block_size=16):
        self.block_size = block_size


class MLAAttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec(FullAttentionSpec):
    def __init__(self, block_size=16, sliding_window=40):
        super().__init__(block_size)
        self.sliding_window = sliding_window


class MambaSpec:
    def __init__(self, mamba_cache_mode="none"):
        self.block_size = 2048
        self.mamba_cache_mode = mamba_cache_mode


class CrossAttentionSpec:
    block_size = 16


def test_the_first_full_attention_group_carries_the_pages_and_a_window_group_is_a_state():
    plan = plan_groups([(0, ("l0", "l2"), SlidingWindowSpec()), (1, ("l1", "l3"), MLAAttentionSpec())], True, 2)
    assert (plan.main.index, plan.main.kind, plan.main.layers) == (1, "full", ("l1", "l3"))
    assert [(g.index, g.kind, g.window) for g in plan.states] == [(0, "window", 40)]
    ids = ([NULL_BLOCK, NULL_BLOCK, 7, 9, 4], [3, 5, 6, 8, 2])
    assert plan.pages(ids, 70) == (3, 5, 6, 8, 2)
    assert plan.pages(ids, 33) == (3, 5, 6)
    assert plan.state_items(ids, 70) == ((-1, -1, 7, 9, 4),)
    # decode's prefix cache holds the first 32 tokens: those window blocks are not written either
    assert plan.state_items(([11, 12, 7, 9, 4], ids[1]), 70, local_tokens=32) == ((-1, -1, 7, 9, 4),)
    assert plan.check_lengths(ids, 70) is None
    assert "group 1 holds 5 blocks for 90 tokens (6)" in plan.check_lengths(ids, 90)
    assert "1 block lists for 2" in plan.check_lengths(ids[:1], 10)


def test_without_the_hybrid_manager_one_group_of_every_layer_moves_whole():
    plan = plan_groups([(0, ("l0", "l1"), SlidingWindowSpec())], False, 1)
    assert plan.main.kind == "full" and plan.states == ()
    assert plan.pages(([1, 2, 3],), 40) == (1, 2, 3)


def test_a_mamba_group_is_a_slot_state_and_decode_computes_the_prompts_last_token():
    plan = plan_groups([(0, ("g0", "g2"), MambaSpec()), (1, ("a1", "a3"), FullAttentionSpec(block_size=160))], True, 2)
    assert (plan.main.index, [g.kind for g in plan.states], plan.replay_last) == (1, ["mamba"], True)
    assert plan.transferred_tokens(300) == 299 and plan.transferred_tokens(1) == 1
    ids = ([NULL_BLOCK, 7], [3, 5])
    assert plan.pages(ids, 299) == (3, 5)
    assert plan.state_items(ids, 299) == ((7,),)  # its state block, a null placeholder dropped
    assert plan.check_lengths(ids, 299) is None
    assert "no state block in group 0" in plan.check_lengths(([NULL_BLOCK], [3, 5]), 299)
    assert not plan_groups([(0, ("a",), FullAttentionSpec())], True, 1).replay_last


@pytest.mark.parametrize("groups, named", [
    ([(0, ("a",), FullAttentionSpec()), (1, ("m",), MambaSpec("align"))], "group 1 caches Mamba state by prefix"),
    ([(0, ("a",), FullAttentionSpec()), (1, ("x",), CrossAttentionSpec())], "group 1 holds CrossAttentionSpec"),
    ([(0, ("a",), SlidingWindowSpec()), (1, ("b",), SlidingWindowSpec(sliding_window=8))],
     "every layer of this model is windowed"),
    ([], "no KV-cache group"),
])
def test_groups_kvferry_does_not_move_are_refused_at_start_up_by_name(groups, named):
    with pytest.raises(ValueError, match=named):
        plan_groups(groups, True, max(len(groups), 1))


def test_regions_inside_another_are_registered_once():
    regions = [(1000, 100), (2000, 50), (1000, 100), (1010, 20), (2040, 30), (500, 10)]
    assert unique_regions(regions) == [(1000, 100), (2000, 50), (2040, 30), (500, 10)]


def test_a_speculative_drafts_layers_are_told_from_the_targets():
    names = ["draft_model.model.layers.0.self_attn.attn", "model.layers.0.self_attn.attn",
             "model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn"]
    assert split_draft(names, None) == (names, [])  # no draft: every layer the target's
    assert split_draft(names, 4) == (names[1:], names[:1])  # vLLM's draft_model method
    assert split_draft(names, 2) == (names[1:3], [names[0], names[3]])  # EAGLE/MTP: layers after the target's
