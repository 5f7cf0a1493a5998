"""Layer-wise sends from vLLM's forward pass, on prefill. Pure.

With ``kvferry_layer_groups`` N > 0 the connector streams a request's KV in
the engine step that completes its prefill: the scheduler half names the
step's completing requests (their blocks are all allocated by then) in the
step's metadata; the worker opens their rooms before the forward pass, and
vLLM's ``save_kv_layer`` (called after each attention layer, on a GPU at
launch, when a CUDA event recorded on the current stream marks the layer's
KV written) finishes the room's layers one by one. Each of the N groups of
target layers (contiguous, in forward order) is sent
(``KVSender.send(pages, layers=...)``) as soon as all its layers are
finished and decode's request has arrived: with the concurrent protocol
(decode's request waits at prefill) while the forward pass goes on; with
the sequential one, once decode asks, after prefill answered (vLLM's proxy
sends decode the request only then). A speculative draft's layers are one
more group, finished when the request finishes (the drafter runs after the
target's forward). The core's ``layerwise_min_tokens`` sends a short room's
groups whole; a fenced decode takes each group through its staging and
scatters it from there as soon as it landed.

:class:`LayerStream` is one room's bookkeeping: which room layers the
forward pass finished, which groups were claimed for sending (each once,
whichever thread finds it complete first), and when.
"""

from __future__ import annotations

import itertools

from dataclasses import dataclass, field


def layer_groups(num_target: int, num_draft: int, groups: int) -> tuple[range, ...]:
    """The room's layers (target's ``0..num_target-1``, then the draft's) in
    ``groups`` contiguous groups of target layers, as even as they split
    (at most one per layer), then the draft's layers as one group."""
    if num_target < 1 or groups < 1:
        raise ValueError(f"layer groups: {num_target} target layers in {groups} groups")
    n = min(groups, num_target)
    bounds = [num_target * i // n for i in range(n + 1)]
    out = [range(a, b) for a, b in itertools.pairwise(bounds)]
    if num_draft:
        out.append(range(num_target, num_target + num_draft))
    return tuple(out)


@dataclass
class LayerStream:
    """One prefill room's layer groups (not thread-safe: the worker's lock)."""

    groups: tuple[range, ...]
    finished: set[int] = field(default_factory=set)  # room layers whose KV is written
    claimed: set[int] = field(default_factory=set)  # indices of the groups claimed for sending
    in_forward: int = 0  # groups claimed while the forward pass was still going (the rest: after it)

    def finish(self, layer: int) -> None:
        self.finished.add(layer)

    def finish_all(self) -> None:
        """The request finished: every layer's KV is written."""
        for g in self.groups:
            self.finished.update(g)

    def claim(self, *, in_forward: bool) -> list[range]:
        """The groups whose every layer is finished and that no one claimed
        yet, now claimed (the caller sends them)."""
        out = []
        for i, g in enumerate(self.groups):
            if i not in self.claimed and all(layer in self.finished for layer in g):
                self.claimed.add(i)
                out.append(g)
        if in_forward:
            self.in_forward += len(out)
        return out

    @property
    def done(self) -> bool:
        """Every group claimed."""
        return len(self.claimed) == len(self.groups)
