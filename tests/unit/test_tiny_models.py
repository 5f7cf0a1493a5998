"""The examples' tiny model pair: paged decode against the unpaged forward
pass, batch invariance, speculative against greedy decoding, TP shards."""

import pytest
import torch

from examples.paged_kv import PagedCache, RankPools, local_cache, pages_for
from examples.speculative import Prefilled, first_token, greedy, reference_tokens, speculative, tokens_needed
from examples.tiny_models import ModelPair, build_models

PAIR = ModelPair()
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return build_models(PAIR)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, PAIR.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def scattered_caches(n_tokens: int, seed: int = 0):
    """Both models' caches over shared NaN-filled pools, on scattered page ids."""
    pools = RankPools.allocate(PAIR, num_pages=64, page_size=PAGE_SIZE)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:pages_for(n_tokens, PAGE_SIZE)]
    return pools, ids.tolist()


def test_cache_shapes_are_the_engines():
    pools = RankPools.allocate(PAIR, num_pages=8, page_size=PAGE_SIZE)
    assert PAIR.target.latent_dim == PAIR.target.kv_lora_rank + PAIR.target.rope_dim
    assert [tuple(t.shape) for t in pools.target] == [(8, PAGE_SIZE, PAIR.target.latent_dim)] * PAIR.target.num_layers
    assert PAIR.draft.num_kv_heads < PAIR.draft.num_heads
    assert tuple(pools.draft_k[0].shape) == (8, PAGE_SIZE, PAIR.draft.num_kv_heads, PAIR.draft.head_dim)
    assert all(t.dtype == torch.float32 for t in (*pools.target, *pools.draft_k, *pools.draft_v))


@pytest.mark.parametrize("which", ["target", "draft"])
@pytest.mark.parametrize("n", [1, 20, 33, 48])
def test_paged_decode_matches_the_unpaged_forward_pass(models, which, n):
    model = dict(zip(["target", "draft"], models))[which]
    new = 12
    pools, pages = scattered_caches(n + new, seed=n)
    cache = pools.target_cache(pages) if which == "target" else pools.draft_cache(pages)
    pre = model.prefill(prompt(n, seed=n))
    for layer, kv in enumerate(pre.kv):
        cache.write(layer, 0, kv)
    tokens, logits = [first_token(pre.logits)], []
    for i in range(new - 1):
        logits.append(model.decode(torch.tensor(tokens[-1:]), n + i, cache)[0])
        tokens.append(int(logits[-1].argmax()))
    full = model.prefill(torch.cat([prompt(n, seed=n), torch.tensor(tokens[:-1])]))
    paged = torch.stack(logits)
    assert torch.isfinite(paged).all(), "decode read a slot nobody wrote (the pools start as NaN)"
    torch.testing.assert_close(paged, full.logits[n:], atol=2e-4, rtol=1e-4)
    assert paged.argmax(-1).tolist() == full.logits[n:].argmax(-1).tolist()
    # The KV that decode wrote for the generated tokens is the forward pass's.
    for layer, kv in enumerate(full.kv):
        for got, want in zip(cache.gather(layer, n + new - 1), kv):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_decode_reads_the_prompt_kv_from_the_pages(models):
    target, _ = models
    n = 40
    pre = target.prefill(prompt(n))
    base = local_cache(pre.kv, n + 4, PAGE_SIZE)
    want = target.decode(torch.tensor([7]), n, base)
    # The same bytes on other, shuffled pages give the same bits...
    pools, pages = scattered_caches(n + 4, seed=3)
    moved = pools.target_cache(pages)
    for layer, kv in enumerate(pre.kv):
        moved.write(layer, 0, kv)
    assert torch.equal(target.decode(torch.tensor([7]), n, moved), want)
    # ...and one token's latent changed in one layer changes the result.
    changed = local_cache(pre.kv, n + 4, PAGE_SIZE)
    changed.write(1, 5, (torch.zeros(1, PAIR.target.latent_dim),))
    assert not torch.equal(target.decode(torch.tensor([7]), n, changed), want)


@pytest.mark.parametrize("which", ["target", "draft"])
def test_decode_is_batch_invariant(models, which):
    model = dict(zip(["target", "draft"], models))[which]
    n, new = 37, torch.tensor([5, 301, 77, 5])
    pre = model.prefill(prompt(n, seed=1))
    together = model.decode(new, n, local_cache(pre.kv, n + 4, PAGE_SIZE))
    alone = local_cache(pre.kv, n + 4, PAGE_SIZE)
    one_by_one = torch.cat([model.decode(new[i:i + 1], n + i, alone) for i in range(4)])
    assert torch.equal(together, one_by_one)


@pytest.mark.parametrize("num_draft", [1, 2, 3, 5])
def test_speculative_decoding_gives_the_greedy_tokens(models, num_draft):
    target, draft = models
    accepted = 0
    for n in (20, 77, 128, 200):
        p = prompt(n, seed=n)
        pre_t, pre_d = target.prefill(p), draft.prefill(p)
        first = first_token(pre_t.logits)
        want = greedy(target, Prefilled(n, first, local_cache(pre_t.kv, n + 40, PAGE_SIZE)), 40)
        size = tokens_needed(n, 40, num_draft)
        gen = speculative(target, draft, Prefilled(n, first, local_cache(pre_t.kv, size, PAGE_SIZE),
                                                   local_cache(pre_d.kv, size, PAGE_SIZE)), 40, num_draft)
        assert gen.tokens == want.tokens
        assert gen.num_target_steps < want.num_target_steps or gen.num_accepted == 0
        accepted += gen.num_accepted
    assert accepted > 0, "the draft never guessed right: speculative decoding was not exercised"


def test_reference_tokens_are_greedy_from_the_prompt(models):
    target, _ = models
    p = prompt(50)
    tokens = reference_tokens(target, [p], 10, PAGE_SIZE)[0]
    full = target.prefill(torch.cat([p, torch.tensor(tokens[:-1])]))
    assert full.logits[49:].argmax(-1).tolist() == tokens


def test_tp_ranks_hold_the_same_latent_and_half_of_the_draft_heads(models):
    target, draft = models
    n = 45  # not a multiple of the page size: the last page is partly filled
    p = prompt(n)
    pre_t, pre_d = target.prefill(p), draft.prefill(p)
    pages = [3, 0, 6]
    whole = RankPools.allocate(PAIR, num_pages=8, page_size=PAGE_SIZE)
    whole.store_prefill(pre_t, pre_d, pages)
    ranks = [RankPools.allocate(PAIR, num_pages=8, page_size=PAGE_SIZE, tp_rank=r, tp_size=2) for r in range(2)]
    for rank in ranks:
        rank.store_prefill(pre_t, pre_d, pages)
        assert rank.draft_k[0].shape[2] == PAIR.draft.num_kv_heads // 2
        for mine, all_heads in zip(rank.target, whole.target):
            assert torch.equal(mine[pages].nan_to_num(), all_heads[pages].nan_to_num())
    for layer in range(PAIR.draft.num_layers):
        for comp in ("draft_k", "draft_v"):
            joined = torch.cat([getattr(r, comp)[layer][pages] for r in ranks], dim=2)
            assert torch.equal(joined.nan_to_num(), getattr(whole, comp)[layer][pages].nan_to_num())
    # Slots past the prompt in the last page were never written.
    assert torch.isnan(whole.target[0][6, n % PAGE_SIZE:]).all()
    assert not torch.isnan(whole.target[0][6, :n % PAGE_SIZE]).any()


def test_paged_cache_refuses_positions_beyond_its_pages():
    pools = RankPools.allocate(PAIR, num_pages=4, page_size=PAGE_SIZE)
    cache: PagedCache = pools.target_cache([2, 1])
    with pytest.raises(ValueError, match="beyond"):
        cache.write(0, 2 * PAGE_SIZE, (torch.zeros(1, PAIR.target.latent_dim),))
    with pytest.raises(ValueError, match="beyond"):
        cache.gather(0, 2 * PAGE_SIZE + 1)
