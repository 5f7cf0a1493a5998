"""Greedy and speculative decoding over paged caches, and the single-process reference.

After prefill, a request is ``prompt_tokens`` positions of KV in each cache
and the first generated token (the target's argmax at the last prompt
position), which is not in any cache yet. Generation continues from there:

- :func:`greedy`: the target decodes one token per step;
- :func:`speculative`: each step the draft proposes ``num_draft`` tokens
  greedily and the target verifies its last token and the proposals in one
  step, keeping the proposals up to the first one it disagrees with, plus its
  own token there (greedy verification). The tokens are those of
  :func:`greedy`, exactly (the models' ``decode`` is batch-invariant).

:func:`reference_tokens` is the single-process run the two-node examples are
checked against: target prefill and plain greedy decoding, no draft, no
transfer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from collections.abc import Iterator, Sequence

import torch

from examples.paged_kv import PagedCache, local_cache


@dataclass(frozen=True)
class Prefilled:
    """A request as decoding starts: ``prompt_tokens`` positions of KV in
    each cache, and the first generated token, which is in no cache yet.
    Each cache must have room for :func:`tokens_needed` positions."""

    prompt_tokens: int
    first_token: int
    target_cache: PagedCache
    draft_cache: PagedCache | None = None  # speculative decoding only


@dataclass
class Generation:
    """The generated tokens, the first one included, and how they came."""

    tokens: list[int]
    num_target_steps: int = 0  # target decode steps after the first token
    num_proposed: int = 0  # draft tokens proposed
    num_accepted: int = 0  # of them, kept by the target


def tokens_needed(prompt_tokens: int, max_new_tokens: int, num_draft: int) -> int:
    """Cache positions a request may write: the prompt, the generated tokens,
    and a verification step's proposals past the last kept token."""
    return prompt_tokens + max_new_tokens + num_draft


def first_token(prefill_logits: torch.Tensor) -> int:
    return int(prefill_logits[-1].argmax())


def greedy(target, req: Prefilled, max_new_tokens: int) -> Generation:
    """Plain greedy decoding of ``max_new_tokens`` tokens, the first included."""
    gen = Generation(tokens=[req.first_token])
    while len(gen.tokens) < max_new_tokens:
        pos = req.prompt_tokens + len(gen.tokens) - 1  # where the last token goes
        logits = target.decode(torch.tensor(gen.tokens[-1:]), pos, req.target_cache)
        gen.tokens.append(int(logits[-1].argmax()))
        gen.num_target_steps += 1
    return gen


def speculative(target, draft, req: Prefilled, max_new_tokens: int, num_draft: int) -> Generation:
    """Speculative decoding with greedy verification: the tokens of :func:`greedy`."""
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    if req.draft_cache is None:
        raise ValueError("speculative decoding needs the draft's cache")
    gen = Generation(tokens=[req.first_token])
    draft_valid = req.prompt_tokens  # positions whose draft KV belongs to kept tokens
    while len(gen.tokens) < max_new_tokens:
        length = req.prompt_tokens + len(gen.tokens)  # the last token sits at length - 1, in no cache yet
        # The draft catches up on kept tokens it has not seen, then proposes.
        unseen = gen.tokens[draft_valid - req.prompt_tokens:]
        logits = draft.decode(torch.tensor(unseen), draft_valid, req.draft_cache)
        proposal = [int(logits[-1].argmax())]
        while len(proposal) < num_draft:
            logits = draft.decode(torch.tensor(proposal[-1:]), length + len(proposal) - 1, req.draft_cache)
            proposal.append(int(logits[-1].argmax()))
        # One target step over the last token and the proposals.
        verified = target.decode(torch.tensor(gen.tokens[-1:] + proposal), length - 1, req.target_cache).argmax(-1)
        accepted = 0
        while accepted < num_draft and proposal[accepted] == int(verified[accepted]):
            accepted += 1
        gen.tokens += proposal[:accepted] + [int(verified[accepted])]
        gen.num_target_steps += 1
        gen.num_proposed += num_draft
        gen.num_accepted += accepted
        # The draft fed the last token and proposals 1..num_draft-1; those kept stay valid.
        draft_valid = length + min(accepted, num_draft - 1)
    del gen.tokens[max_new_tokens:]
    return gen


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run torch ops on ``num_threads`` threads, as every node process does."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_tokens(target, prompts: Sequence[torch.Tensor], max_new_tokens: int,
                     page_size: int) -> list[list[int]]:
    """The single-process run: per prompt, target prefill, then plain greedy
    decoding over a private paged cache."""
    out = []
    with torch_threads(1):
        for prompt in prompts:
            pre = target.prefill(prompt)
            cache = local_cache(pre.kv, tokens_needed(prompt.numel(), max_new_tokens, 0), page_size)
            out.append(greedy(target, Prefilled(prompt.numel(), first_token(pre.logits), cache), max_new_tokens).tokens)
    return out
