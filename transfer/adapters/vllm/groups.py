"""vLLM's KV-cache groups as kvferry pools. Pure: imports neither vLLM, torch,
zmq nor Mooncake (vLLM's specs are read by their class names).

With vLLM's hybrid KV-cache manager (HMA) a model's layers fall into KV-cache
groups, each with a block table of its own: full-attention layers in one (or
several), sliding-window layers in others, whose blocks before the window
vLLM frees and lists as its null block. The connector maps

- the first full-attention group to kvferry's KV pool (the room's pages),
- every other attention group (full or windowed) to a page-indexed state
  pool of its own (:class:`transfer.StatePool`, ``exact=False``), its block
  ids the room's state items, a freed (null) block's position as -1: decode
  does not ask for it, and a position decode wants but prefill freed fails
  the room naming it (:func:`transfer.plan.pair_state_items`);
- a Mamba/GDN group (vLLM's ``MambaSpec``: a request's conv and SSM state in
  one block of each of its layers) to a slot state pool (``exact``): its
  non-null block ids are the items, matched one for one. As in vLLM's own
  connectors, prefill computes the prompt but its last token and decode
  computes that token itself (:attr:`GroupPlan.replay_last`): a recurrent
  state cannot be rewound, and decode must run the prompt's last token to
  get its logits.

What it does not map is refused at start-up with the reason
(:func:`plan_groups` raises ValueError): attention types other than full and
sliding-window, Mamba state with vLLM's prefix caching of it
(``mamba_cache_mode`` other than ``none``), and a model with no
full-attention group (every layer windowed: run it with
``--disable-hybrid-kv-cache-manager``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Sequence

#: vLLM's null block: the positions a group does not hold (a window's freed blocks).
NULL_BLOCK = 0

_FULL = "FullAttentionSpec"
_WINDOW = "SlidingWindowSpec"
_MAMBA = "MambaSpec"


def _kind(spec) -> str:
    """``full``, ``window``, ``mamba``, or the spec's own class name (not mapped)."""
    names = {c.__name__ for c in type(spec).__mro__}
    if _WINDOW in names:
        return "window"
    if _FULL in names:
        return "full"
    if _MAMBA in names:
        return "mamba"
    return type(spec).__name__


@dataclass(frozen=True)
class Group:
    """One transferred KV-cache group: its index among vLLM's groups, its
    layers (in :func:`layer_order`), its kind (``full``, ``window`` or ``mamba``) and its block size
    (a Mamba group's: the tokens its one block per request stands for)."""

    index: int
    layers: tuple[str, ...]
    kind: str
    block_size: int
    window: int = 0  # tokens, for a windowed group


@dataclass(frozen=True)
class GroupPlan:
    """The groups kvferry moves: ``main`` (the KV pool's) and ``states`` (one
    state pool each, in order). Without HMA: one group of every layer."""

    main: Group
    states: tuple[Group, ...] = ()
    num_groups: int = 1  # vLLM's groups in all (block_ids tuples have this many)

    @property
    def groups(self) -> tuple[Group, ...]:
        return (self.main, *self.states)

    @property
    def replay_last(self) -> bool:
        """Prefill leaves the prompt's last token to decode (a recurrent state is moved)."""
        return any(g.kind == "mamba" for g in self.states)

    def transferred_tokens(self, num_prompt_tokens: int) -> int:
        """The prompt tokens whose KV and state move (decode computes the rest)."""
        return num_prompt_tokens - 1 if self.replay_last and num_prompt_tokens > 1 else num_prompt_tokens

    def pages(self, block_ids: Sequence[Sequence[int]], num_tokens: int) -> tuple[int, ...]:
        """The main group's blocks of ``num_tokens`` tokens."""
        return tuple(block_ids[self.main.index][:_num_pages(num_tokens, self.main.block_size)])

    def state_items(self, block_ids: Sequence[Sequence[int]], num_tokens: int,
                    local_tokens: int = 0) -> tuple[tuple[int, ...], ...]:
        """Per state group, its blocks of ``num_tokens`` tokens, a null
        block's position (and, on decode, a block its prefix cache holds:
        the first ``local_tokens`` tokens) as -1."""
        out = []
        for g in self.states:
            if g.kind == "mamba":  # the request's state blocks, whatever the tokens (nulls: placeholders)
                out.append(tuple(int(b) for b in block_ids[g.index] if b != NULL_BLOCK))
                continue
            ids = list(block_ids[g.index][:_num_pages(num_tokens, g.block_size)])
            held = local_tokens // g.block_size
            out.append(tuple(-1 if b == NULL_BLOCK or i < held else int(b) for i, b in enumerate(ids)))
        return tuple(out)

    def check_lengths(self, block_ids: Sequence[Sequence[int]], num_tokens: int) -> str | None:
        """Why these blocks cannot carry ``num_tokens`` tokens (None: they can)."""
        if len(block_ids) != self.num_groups:
            return f"{len(block_ids)} block lists for {self.num_groups} KV-cache groups"
        for g in self.groups:
            if g.kind == "mamba":
                if not any(b != NULL_BLOCK for b in block_ids[g.index]):
                    return f"no state block in group {g.index}"
                continue
            need = _num_pages(num_tokens, g.block_size)
            if len(block_ids[g.index]) < need:
                return f"group {g.index} holds {len(block_ids[g.index])} blocks for {num_tokens} tokens ({need})"
        return None


def layer_order(name: str) -> tuple:
    """A sort key: ``model.layers.10.self_attn.attn`` after ``model.layers.9...``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _num_pages(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def plan_groups(groups: Sequence, hma: bool, num_groups: int) -> GroupPlan:
    """``groups``: vLLM's transferred KV-cache groups as (index, layer names,
    spec) triples, the spec with ``block_size`` (and ``sliding_window`` for
    a windowed one); ``num_groups``: vLLM's groups in all. ``hma``: vLLM's
    hybrid manager is on (else the model's layers are one group, windowed
    or not, kept whole). Raises ValueError naming what is not supported."""
    if not groups:
        raise ValueError("kvferry vLLM connector: the model has no KV-cache group to transfer")
    made = []
    for index, layers, spec in groups:
        kind = _kind(spec)
        if not hma:
            kind = "full"  # one group, every block held (vLLM keeps windows whole without HMA)
        if kind not in ("full", "window", "mamba"):
            raise ValueError(f"kvferry vLLM connector: KV-cache group {index} holds {kind} layers, which kvferry "
                             "does not move inside vLLM (supported: full and sliding-window attention, Mamba/GDN "
                             "state)")
        mode = str(getattr(spec, "mamba_cache_mode", "none") or "none")
        if kind == "mamba" and mode != "none":
            raise ValueError(f"kvferry vLLM connector: KV-cache group {index} caches Mamba state by prefix "
                             f"(mamba_cache_mode {mode!r}), which kvferry does not move; run the PD servers "
                             "without prefix caching (--no-enable-prefix-caching)")
        made.append(Group(index=int(index), layers=tuple(sorted(layers, key=layer_order)), kind=kind, block_size=int(spec.block_size),
                          window=int(getattr(spec, "sliding_window", 0) or 0) if kind == "window" else 0))
    main = next((g for g in made if g.kind == "full"), None)
    if main is None:
        raise ValueError("kvferry vLLM connector: every layer of this model is windowed (no full-attention "
                         "KV-cache group to carry the request's pages); run it with "
                         "--disable-hybrid-kv-cache-manager")
    return GroupPlan(main=main, states=tuple(g for g in made if g is not main), num_groups=int(num_groups))


def split_draft(names: Sequence[str], num_target_layers: int | None) -> tuple[list[str], list[str]]:
    """A KV-cache group's layer names as (target, draft): vLLM names a
    speculative draft's attention layers ``draft_model.…`` (method
    ``draft_model``) or numbers them after the target's
    ``num_target_layers`` layers (EAGLE, MTP: ``model.layers.<N>`` with N
    at least that). ``num_target_layers`` None: no draft."""
    target, draft = [], []
    for name in names:
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        late = num_target_layers is not None and m is not None and int(m.group(1)) >= num_target_layers
        (draft if num_target_layers is not None and (name.startswith("draft_model.") or late) else target).append(name)
    return target, draft
