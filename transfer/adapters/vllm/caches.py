"""vLLM's KV cache as kvferry's pools, for the worker halves
(:mod:`~transfer.adapters.vllm.worker`): what the connector knows of the
cache beyond its tensors (:class:`CacheLayout`), MLA latents as pages of
the scheduler's logical block, the hybrid manager's other KV-cache groups
as state pools, and the checks that refuse what would move wrong tokens.
Views only: no KV byte is copied here."""

from __future__ import annotations

from dataclasses import dataclass

from transfer.adapters.vllm.groups import Group

@dataclass(frozen=True)
class CacheLayout:
    """What the connector knows of vLLM's KV cache beyond the tensors:
    ``total_kv_heads`` (the model's; None: this rank's, right for TP 1),
    ``kv_layout`` (``fused_rows`` on vLLM's CPU backend, ``fused_cells`` on
    the GPU backends) and ``vllm_layout`` (vLLM's resolved KVCacheLayout
    name, checked against the tensors' strides when given)."""

    total_kv_heads: int | None = None
    kv_layout: str = "fused_rows"
    vllm_layout: str | None = None
    mla: bool = False  # one latent tensor per layer (DeepSeek-style MLA)
    block_size: int | None = None  # vLLM's logical block (the scheduler's block ids); None: the tensors'
    #: with a speculative draft: the target model's layers (later ones and ``draft_model.*`` are the draft's)
    target_layers: int | None = None
    draft_kv_heads: int | None = None  # the draft model's KV heads (its pool's ``total_kv_heads``)


def mla_layers(layers: list, block_size: int | None) -> list:
    """vLLM's MLA caches as kvferry's latent pages of the scheduler's
    (logical) block: each ``[kernel_blocks, kernel_block, latent]`` tensor
    (with a head dimension of 1 before or after the tokens, as vLLM's CPU and
    GPU MLA backends shape it) viewed as ``[blocks, block_size, latent]``. vLLM splits a logical
    block into ``block_size / kernel_block`` consecutive kernel blocks (the
    CPU MLA backend's kernel block is 16), so logical block b is rows
    ``b * block_size ...`` of the same memory: a view, no copy."""
    out = []
    for i, t in enumerate(layers):
        if t.dim() == 4 and 1 in (t.shape[1], t.shape[2]):  # one latent "head", before or after the tokens
            t = t.select(1 if t.shape[1] == 1 else 2, 0)
        if t.dim() != 3 or not t.is_contiguous():
            raise ValueError(f"kvferry vLLM worker: MLA layer {i}: expected a contiguous [blocks, block_size, "
                             f"latent] cache, got shape {tuple(t.shape)} strides {t.stride()}")
        kernel = int(t.shape[1])
        size = block_size or kernel
        if size % kernel or (t.shape[0] * kernel) % size:
            raise ValueError(f"kvferry vLLM worker: MLA layer {i}: logical block size {size} is not a whole "
                             f"number of kernel blocks of {kernel} tokens ({t.shape[0]} kernel blocks)")
        out.append(t.view(t.shape[0] * kernel // size, size, t.shape[2]))
    return out


def group_state_pool(group: Group, layers: list, mla: bool):
    """A KV-cache group beside the main one (HMA) as a page-indexed state
    pool: one buffer per layer, a block of the group one item (K and V of
    this rank's heads). MHA is sharded by heads (the item's head axis is
    its slice axis, so prefill and decode TP may differ); MLA's latent is
    the same on every rank (replicated)."""
    from transfer.state_pools import StatePool

    if group.kind == "mamba":
        return mamba_state_pool(group, layers)
    buffers, slicing = [], []
    for i, t in enumerate(layers):
        if t.dim() != 4 or not t.is_contiguous():
            raise ValueError(f"kvferry vLLM worker: KV-cache group {group.index} layer {i} ({group.layers[i]}): "
                             f"expected a contiguous [blocks, heads, block_size, width] cache, got shape "
                             f"{tuple(t.shape)} strides {t.stride()}")
        heads = int(t.shape[1])
        buffers.append(t.view(t.shape[0], -1))  # a block per row: a view
        slicing.append(None if mla else (heads, 1, ()))  # [B, H, N, C]: this rank's heads outermost
    return StatePool(kind=f"vllm-group{group.index}", buffers=tuple(buffers),
                     sharding="replicated" if mla else "sharded", exact=False, slicing=tuple(slicing))


def mamba_state_pool(group: Group, layers: list):
    """A Mamba/GDN group as a slot state pool: per layer, a buffer of its
    blocks, a block (the request's conv and SSM state, vLLM's padded page)
    one item. vLLM hands each layer a view of its pages (``[blocks, ...]``,
    a block's stride the padded page); kvferry takes the whole page, a view
    of the same memory. Sharded by TP rank without a slice axis: prefill and
    decode TP must be equal (the handshake refuses others by name)."""
    import torch

    from transfer.state_pools import StatePool

    buffers = []
    for i, t in enumerate(layers):
        if isinstance(t, (list, tuple)):  # per-state views: the page starts at the first one
            t = t[0]
        page = t.stride(0) * t.element_size() if t.dim() else 0
        if t.dim() < 2 or page < t[0].numel() * t.element_size() or not t[0].is_contiguous():
            raise ValueError(f"kvferry vLLM worker: Mamba group {group.index} layer {i} ({group.layers[i]}): "
                             f"expected [blocks, ...] with contiguous blocks, got shape {tuple(t.shape)} strides "
                             f"{t.stride()}")
        rows = torch.empty(0, dtype=torch.uint8, device=t.device)  # the same memory, a page per row
        rows.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (t.shape[0], page), (page, 1))
        buffers.append(rows)
    return StatePool(kind=f"vllm-group{group.index}", buffers=tuple(buffers), sharding="sharded", exact=True)


def check_block_size(page_size: int, block_size: int | None) -> None:
    """vLLM's block ids name logical blocks; a fused K/V cache whose kernel
    block differs (its pages are not one logical block each) would move the
    wrong tokens: refused."""
    if block_size is not None and page_size != block_size:
        raise ValueError(f"kvferry vLLM worker: the KV cache's kernel block holds {page_size} tokens and vLLM's "
                         f"logical block {block_size}: kvferry moves whole logical blocks of MHA caches only where "
                         f"the two are equal (set --block-size {page_size})")


def written_event(kv_layer):
    """A CUDA event recorded now on the current stream, after the layer's
    KV writes vLLM launched (None on the CPU: written already)."""
    if isinstance(kv_layer, (list, tuple)):  # a backend's per-layer K and V
        kv_layer = kv_layer[0] if kv_layer else None
    if not getattr(kv_layer, "is_cuda", False):
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


def kv_pool(layers: list, role, total_kv_heads: int | None, layout: CacheLayout):
    """One pool of vLLM's layers: MLA's latent (identical on every TP rank:
    one prefill rank sends it, the selective send) or fused K/V of this
    rank's heads of ``total_kv_heads``."""
    from transfer.pools import FusedKVPool, MLAPool, describe_fused

    if layout.mla:
        return MLAPool(latent=mla_layers(layers, layout.block_size), role=role)
    pool = FusedKVPool(kv=layers, role=role, total_kv_heads=total_kv_heads, kv_layout=layout.kv_layout,
                       vllm_layout=layout.vllm_layout)
    check_block_size(describe_fused(pool).page_size, layout.block_size)
    return pool
