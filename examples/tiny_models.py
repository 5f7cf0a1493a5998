"""A tiny DeepSeek-style MLA target and a tiny Llama-style GQA draft, in plain torch.

Seeded random weights (nothing is downloaded), float32, about a millisecond
a token on one CPU core. Both models share one vocabulary, token embedding
and LM head, as MTP- and EAGLE-style drafts share their target's, and their
layers add small updates (``out_scale``) to the residual stream, so the draft
guesses the target's next token often enough (about 40% of its proposals are
kept) while the target's tokens still depend on the whole context.

KV cache per token and layer, as the serving engine's pools hold it:

- target (MLA): one latent vector of ``kv_lora_rank + rope_dim`` elements, the
  RMS-normed compressed KV followed by the rotated rope key that all heads
  share; one component, ``(latent,)``;
- draft (GQA): K and V of ``num_kv_heads`` heads (fewer than the query heads)
  of ``head_dim``; two components, ``(k, v)``.

Each model has two entry points:

- ``prefill(tokens)``: the causal forward pass over a whole prompt in one
  batched pass; returns every layer's KV, unpaged, and the logits;
- ``decode(tokens, start, cache)``: the forward pass of new tokens at
  positions ``start, start + 1, ...`` over a paged cache (anything with
  ``write(layer, pos, values)`` and ``gather(layer, length)``, such as
  :class:`examples.paged_kv.PagedCache`): each token's KV is written into the
  cache, then it attends over cache positions ``0..pos``. The prompt's KV
  must already be in the cache; decode never sees the prompt's tokens.

Batch invariance: ``decode`` computes its tokens one row at a time, so a
token's logits are bit-identical whether it is decoded alone (plain greedy
decoding) or among the ``k + 1`` tokens of a speculative verification step.
Batched float32 kernels choose their blocking by shape, and a last-bit
difference could flip a near-tie argmax; row by row, speculative decoding
with greedy verification reproduces plain greedy decoding exactly. The RoPE
angles come from a table for the same reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

DTYPE = torch.float32


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """The target. ``latent_dim`` is what the cache holds per token and layer."""

    num_layers: int = 3
    hidden: int = 64
    num_heads: int = 4
    kv_lora_rank: int = 32
    rope_dim: int = 16
    nope_dim: int = 16  # per-head query/key dims without rope
    v_head_dim: int = 16
    mlp_hidden: int = 128
    out_scale: float = 0.2  # scale of what each layer adds to the residual stream

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True, kw_only=True)
class GQAConfig:
    """The draft: ``num_heads`` query heads share ``num_kv_heads`` KV heads."""

    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    mlp_hidden: int = 128
    out_scale: float = 0.2  # scale of what each layer adds to the residual stream


@dataclass(frozen=True, kw_only=True)
class ModelPair:
    """Both models' shapes and the seed of all weights; the vocabulary,
    embedding and LM head are shared."""

    vocab_size: int = 512
    max_positions: int = 2048
    seed: int = 0
    target: MLAConfig = MLAConfig()
    draft: GQAConfig = GQAConfig()

    def __post_init__(self) -> None:
        if self.target.hidden != self.draft.hidden:
            raise ValueError("target and draft share the embedding: hidden sizes must match")
        if self.target.rope_dim % 2 or self.draft.head_dim % 2:
            raise ValueError("rope dims must be even")


class PagedKV(Protocol):
    """What ``decode`` needs of a request's paged cache."""

    def write(self, layer: int, pos: int, values: tuple[torch.Tensor, ...]) -> None:
        """Store the KV components of tokens at positions ``pos, pos + 1, ...``."""

    def gather(self, layer: int, length: int) -> tuple[torch.Tensor, ...]:
        """The KV components of positions ``0..length-1``, each ``[length, ...]``."""


@dataclass(frozen=True)
class PrefillOutput:
    """``kv[layer]`` holds a layer's cache components for every prompt token
    (``(latent [n, latent_dim],)`` or ``(k [n, kv_heads, head_dim], v)``);
    ``logits`` is ``[n, vocab]``."""

    kv: list[tuple[torch.Tensor, ...]]
    logits: torch.Tensor


# --- building blocks --------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class _Init:
    """Seeded weights, scaled by fan-in so activations stay near unit size."""

    def __init__(self, seed: int) -> None:
        self._gen = torch.Generator().manual_seed(seed)

    def linear(self, fan_in: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(fan_in, *shape, generator=self._gen, dtype=DTYPE) * (scale / math.sqrt(fan_in))

    def norm(self, dim: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dim, generator=self._gen, dtype=DTYPE)

    def embedding(self, vocab_size: int, hidden: int) -> torch.Tensor:
        return torch.randn(vocab_size, hidden, generator=self._gen, dtype=DTYPE)


class _Rope:
    """Rotary embedding over a precomputed angle table (exact lookups)."""

    def __init__(self, dim: int, max_positions: int, base: float = 10000.0) -> None:
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.cos, self.sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of ``[n, dim]`` or ``[n, heads, dim]`` at positions ``pos`` of ``[n]``."""
        if int(pos.max()) >= self.cos.shape[0]:
            raise ValueError(f"position {int(pos.max())} beyond the model's {self.cos.shape[0]}")
        cos, sin = self.cos[pos], self.sin[pos]
        if x.dim() == 3:
            cos, sin = cos[:, None, :], sin[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class _Mlp:
    def __init__(self, init: _Init, hidden: int, mlp_hidden: int, out_scale: float) -> None:
        self.norm = init.norm(hidden)
        self.gate, self.up = init.linear(hidden, mlp_hidden), init.linear(hidden, mlp_hidden)
        self.down = init.linear(mlp_hidden, hidden, scale=out_scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        a = _rms_norm(x, self.norm)
        return x + (torch.nn.functional.silu(a @ self.gate) * (a @ self.up)) @ self.down


class _Shared:
    """Embedding, final norm and LM head shared by target and draft."""

    def __init__(self, pair: ModelPair) -> None:
        init = _Init(pair.seed)
        hidden = pair.target.hidden
        self.embed = init.embedding(pair.vocab_size, hidden)
        self.final_norm = init.norm(hidden)
        self.lm_head = init.linear(hidden, pair.vocab_size)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return _rms_norm(h, self.final_norm) @ self.lm_head


class _Model:
    """Shared driver: embedding, layers, head; subclasses define a layer."""

    num_layers: int

    def __init__(self, shared: _Shared) -> None:
        self.shared = shared

    def prefill(self, tokens: torch.Tensor) -> PrefillOutput:
        """Causal forward over ``tokens`` (``[n]`` ints) at positions ``0..n-1``."""
        pos = torch.arange(tokens.numel())
        h = self.shared.embed[tokens]
        kv = []
        for layer in range(self.num_layers):
            h, layer_kv = self._prefill_layer(layer, h, pos)
            kv.append(layer_kv)
        return PrefillOutput(kv=kv, logits=self.shared.logits(h))

    def decode(self, tokens: torch.Tensor, start: int, cache: PagedKV) -> torch.Tensor:
        """Logits ``[m, vocab]`` of ``m`` new tokens at positions ``start..start+m-1``,
        attending over the cache, which then holds their KV as well. Row by
        row: see the module docstring."""
        h = self.shared.embed[tokens]
        rows = []
        for i in range(tokens.numel()):
            x = h[i:i + 1]
            for layer in range(self.num_layers):
                x = self._decode_layer(layer, x, start + i, cache)
            rows.append(self.shared.logits(x))
        return torch.cat(rows)


def _causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``[heads, n, n]`` scores, future masked."""
    n = scores.shape[-1]
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1)


class TinyMLA(_Model):
    """DeepSeek-style multi-head latent attention. The cache holds the latent
    vector; decode absorbs the key up-projection into the query and the value
    up-projection into the output, as MLA serving kernels do."""

    def __init__(self, pair: ModelPair, shared: _Shared) -> None:
        super().__init__(shared)
        cfg = self.cfg = pair.target
        init = _Init(pair.seed + 1)
        qk_dim = cfg.nope_dim + cfg.rope_dim
        self.scale = 1.0 / math.sqrt(qk_dim)
        self.num_layers = cfg.num_layers
        self.rope = _Rope(cfg.rope_dim, pair.max_positions)
        self.layers = []
        for _ in range(cfg.num_layers):
            self.layers.append(dict(
                norm=init.norm(cfg.hidden),
                wq=init.linear(cfg.hidden, cfg.num_heads * qk_dim),
                wkv_a=init.linear(cfg.hidden, cfg.latent_dim),
                kv_norm=init.norm(cfg.kv_lora_rank),
                w_uk=init.linear(cfg.kv_lora_rank, cfg.num_heads, cfg.nope_dim),
                w_uv=init.linear(cfg.kv_lora_rank, cfg.num_heads, cfg.v_head_dim),
                wo=init.linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden, scale=cfg.out_scale),
                mlp=_Mlp(init, cfg.hidden, cfg.mlp_hidden, cfg.out_scale)))

    def _qkv(self, w: dict, h: torch.Tensor, pos: torch.Tensor):
        cfg = self.cfg
        a = _rms_norm(h, w["norm"])
        q = (a @ w["wq"]).view(-1, cfg.num_heads, cfg.nope_dim + cfg.rope_dim)
        q_nope, q_pe = q.split([cfg.nope_dim, cfg.rope_dim], dim=-1)
        kv_a = a @ w["wkv_a"]
        c = _rms_norm(kv_a[:, :cfg.kv_lora_rank], w["kv_norm"])
        latent = torch.cat([c, self.rope(kv_a[:, cfg.kv_lora_rank:], pos)], dim=-1)
        return q_nope, self.rope(q_pe, pos), latent

    def _prefill_layer(self, layer: int, h: torch.Tensor, pos: torch.Tensor):
        cfg, w = self.cfg, self.layers[layer]
        q_nope, q_pe, latent = self._qkv(w, h, pos)
        c, k_pe = latent.split([cfg.kv_lora_rank, cfg.rope_dim], dim=-1)
        k_nope = torch.einsum("tr,rhd->thd", c, w["w_uk"])
        v = torch.einsum("tr,rhd->thd", c, w["w_uv"])
        scores = torch.einsum("qhd,thd->hqt", q_nope, k_nope) + torch.einsum("qhd,td->hqt", q_pe, k_pe)
        probs = _causal_softmax(scores * self.scale)
        out = torch.einsum("hqt,thd->qhd", probs, v).reshape(h.shape[0], -1)
        return w["mlp"](h + out @ w["wo"]), (latent,)

    def _decode_layer(self, layer: int, x: torch.Tensor, pos: int, cache: PagedKV) -> torch.Tensor:
        cfg, w = self.cfg, self.layers[layer]
        q_nope, q_pe, latent = self._qkv(w, x, torch.tensor([pos]))
        cache.write(layer, pos, (latent,))
        (cached,) = cache.gather(layer, pos + 1)
        c, k_pe = cached.split([cfg.kv_lora_rank, cfg.rope_dim], dim=-1)
        q_latent = torch.einsum("hd,rhd->hr", q_nope[0], w["w_uk"])
        scores = q_latent @ c.T + q_pe[0] @ k_pe.T  # [heads, pos + 1]
        out_latent = (scores * self.scale).softmax(-1) @ c
        out = torch.einsum("hr,rhd->hd", out_latent, w["w_uv"]).reshape(1, -1)
        return w["mlp"](x + out @ w["wo"])


class TinyGQA(_Model):
    """Llama-style grouped-query attention: K and V per KV head in the cache."""

    def __init__(self, pair: ModelPair, shared: _Shared) -> None:
        super().__init__(shared)
        cfg = self.cfg = pair.draft
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        init = _Init(pair.seed + 2)
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.num_layers = cfg.num_layers
        self.rope = _Rope(cfg.head_dim, pair.max_positions)
        kv_width = cfg.num_kv_heads * cfg.head_dim
        self.layers = [dict(norm=init.norm(cfg.hidden), wq=init.linear(cfg.hidden, cfg.num_heads * cfg.head_dim),
                            wk=init.linear(cfg.hidden, kv_width), wv=init.linear(cfg.hidden, kv_width),
                            wo=init.linear(cfg.num_heads * cfg.head_dim, cfg.hidden, scale=cfg.out_scale),
                            mlp=_Mlp(init, cfg.hidden, cfg.mlp_hidden, cfg.out_scale))
                       for _ in range(cfg.num_layers)]

    def _qkv(self, w: dict, h: torch.Tensor, pos: torch.Tensor):
        cfg = self.cfg
        a = _rms_norm(h, w["norm"])
        q = self.rope((a @ w["wq"]).view(-1, cfg.num_heads, cfg.head_dim), pos)
        k = self.rope((a @ w["wk"]).view(-1, cfg.num_kv_heads, cfg.head_dim), pos)
        return q, k, (a @ w["wv"]).view(-1, cfg.num_kv_heads, cfg.head_dim)

    def _prefill_layer(self, layer: int, h: torch.Tensor, pos: torch.Tensor):
        w = self.layers[layer]
        q, k, v = self._qkv(w, h, pos)
        kk, vv = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        probs = _causal_softmax(torch.einsum("qhd,thd->hqt", q, kk) * self.scale)
        out = torch.einsum("hqt,thd->qhd", probs, vv).reshape(h.shape[0], -1)
        return w["mlp"](h + out @ w["wo"]), (k, v)

    def _decode_layer(self, layer: int, x: torch.Tensor, pos: int, cache: PagedKV) -> torch.Tensor:
        w = self.layers[layer]
        q, k, v = self._qkv(w, x, torch.tensor([pos]))
        cache.write(layer, pos, (k, v))
        kk, vv = (t.repeat_interleave(self.group, dim=1) for t in cache.gather(layer, pos + 1))
        probs = (torch.einsum("hd,thd->ht", q[0], kk) * self.scale).softmax(-1)
        out = torch.einsum("ht,thd->hd", probs, vv).reshape(1, -1)
        return w["mlp"](x + out @ w["wo"])


def build_models(pair: ModelPair = ModelPair()) -> tuple[TinyMLA, TinyGQA]:
    """The target and the draft, with their shared embedding and head."""
    shared = _Shared(pair)
    return TinyMLA(pair, shared), TinyGQA(pair, shared)
