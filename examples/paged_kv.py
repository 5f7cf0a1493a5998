"""Paged KV pools of the tiny model pair, as a serving engine holds them.

One rank's pools (:class:`RankPools`):

- target (MLA), per layer one latent tensor ``[num_pages, page_size, latent_dim]``,
  the same on every TP rank;
- draft (GQA), per layer a K and a V tensor
  ``[num_pages, page_size, kv_heads_of_this_rank, head_dim]``: with TP 2 each
  rank holds half of the KV heads (``transfer.tp.heads_of``).

A request owns some pages of each pool, listed in its page table (the same
page ids in both pools); :class:`PagedCache` is its view of one model's
pools, the ``write``/``gather`` pair the models' ``decode`` reads and writes
through. Pools start out as NaN, so a model that read a slot nobody wrote
would produce NaN logits rather than a plausible token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from collections.abc import Sequence

import torch

from examples.tiny_models import DTYPE, ModelPair, PrefillOutput
from transfer import MHAPool, MLAPool, PoolRole
from transfer.tp import heads_of


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class PagedCache:
    """One request's view of one model's paged pools: ``layers[l]`` is the
    layer's component tensors, each ``[num_pages, page_size, ...]``, and
    ``pages`` the request's page ids, in order (position ``p`` lives in page
    ``pages[p // page_size]``, slot ``p % page_size``)."""

    def __init__(self, layers: Sequence[tuple[torch.Tensor, ...]], pages: Sequence[int]) -> None:
        self.layers = layers
        self.pages = torch.as_tensor(list(pages), dtype=torch.long)
        self.page_size = int(layers[0][0].shape[1])

    @property
    def capacity_tokens(self) -> int:
        return self.pages.numel() * self.page_size

    def write(self, layer: int, pos: int, values: tuple[torch.Tensor, ...]) -> None:
        """Store tokens' components (each ``[n, ...]``) at positions ``pos..pos+n-1``."""
        n = values[0].shape[0]
        if pos + n > self.capacity_tokens:
            raise ValueError(f"positions up to {pos + n - 1} beyond the request's {self.capacity_tokens} slots")
        positions = torch.arange(pos, pos + n)
        page, slot = self.pages[positions // self.page_size], positions % self.page_size
        for pool, value in zip(self.layers[layer], values, strict=True):
            pool[page, slot] = value

    def gather(self, layer: int, length: int) -> tuple[torch.Tensor, ...]:
        """Positions ``0..length-1`` of each component, gathered by page id."""
        if length > self.capacity_tokens:
            raise ValueError(f"{length} positions beyond the request's {self.capacity_tokens} slots")
        used = self.pages[:pages_for(length, self.page_size)]
        return tuple(pool[used].flatten(0, 1)[:length] for pool in self.layers[layer])


class PageAllocator:
    """A pool's free page ids, handed out in a seeded random order (as a
    long-running engine's free list looks)."""

    def __init__(self, num_pages: int, seed: int) -> None:
        self._free = list(range(num_pages))
        random.Random(seed).shuffle(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise MemoryError(f"{num_pages} pages asked, {len(self._free)} free")
        taken, self._free = self._free[:num_pages], self._free[num_pages:]
        return taken

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(pages)


@dataclass(frozen=True)
class RankPools:
    """The target and draft pools of one TP rank (see the module docstring)."""

    target: list[torch.Tensor]
    draft_k: list[torch.Tensor]
    draft_v: list[torch.Tensor]
    draft_head_start: int  # first global draft KV head this rank holds
    draft_total_heads: int

    @staticmethod
    def allocate(pair: ModelPair, *, num_pages: int, page_size: int, tp_rank: int = 0,
                 tp_size: int = 1) -> RankPools:
        heads = heads_of(tp_rank, tp_size, pair.draft.num_kv_heads)

        def pool(*token_shape: int) -> torch.Tensor:
            return torch.full((num_pages, page_size, *token_shape), float("nan"), dtype=DTYPE)

        draft_shape = (heads.count, pair.draft.head_dim)
        return RankPools(target=[pool(pair.target.latent_dim) for _ in range(pair.target.num_layers)],
                         draft_k=[pool(*draft_shape) for _ in range(pair.draft.num_layers)],
                         draft_v=[pool(*draft_shape) for _ in range(pair.draft.num_layers)],
                         draft_head_start=heads.start, draft_total_heads=pair.draft.num_kv_heads)

    @property
    def num_pages(self) -> int:
        return int(self.target[0].shape[0])

    @property
    def page_size(self) -> int:
        return int(self.target[0].shape[1])

    @property
    def page_bytes(self) -> int:
        """KV bytes one page holds over every layer of both pools."""
        return sum(t[0].numel() * t.element_size() for t in (*self.target, *self.draft_k, *self.draft_v))

    def kvferry_pools(self) -> list[MLAPool | MHAPool]:
        """The pools as a KVManager takes them."""
        return [MLAPool(latent=self.target, role=PoolRole.TARGET),
                MHAPool(k=self.draft_k, v=self.draft_v, role=PoolRole.DRAFT, total_kv_heads=self.draft_total_heads)]

    def target_cache(self, pages: Sequence[int]) -> PagedCache:
        return PagedCache([(t,) for t in self.target], pages)

    def draft_cache(self, pages: Sequence[int]) -> PagedCache:
        return PagedCache(list(zip(self.draft_k, self.draft_v)), pages)

    def store_prefill(self, target: PrefillOutput, draft: PrefillOutput, pages: Sequence[int]) -> None:
        """Write a prompt's KV of both models into ``pages``; the draft's
        heads are cut to this rank's share. Slots past the prompt in the last
        page keep whatever they held."""
        heads = slice(self.draft_head_start, self.draft_head_start + self.draft_k[0].shape[2])
        target_cache, draft_cache = self.target_cache(pages), self.draft_cache(pages)
        for layer, kv in enumerate(target.kv):
            target_cache.write(layer, 0, kv)
        for layer, (k, v) in enumerate(draft.kv):
            draft_cache.write(layer, 0, (k[:, heads], v[:, heads]))


def local_cache(kv: list[tuple[torch.Tensor, ...]], capacity_tokens: int, page_size: int) -> PagedCache:
    """A private paged cache for one request (the single-process reference):
    fresh pools of just enough pages, holding ``kv`` from position 0."""
    num_pages = pages_for(capacity_tokens, page_size)
    layers = [tuple(torch.full((num_pages, page_size, *t.shape[1:]), float("nan"), dtype=DTYPE) for t in comps)
              for comps in kv]
    cache = PagedCache(layers, range(num_pages))
    for layer, comps in enumerate(kv):
        cache.write(layer, 0, comps)
    return cache
