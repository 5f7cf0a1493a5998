"""SGLang's ``KVArgs`` -> kvferry pools and aux rows; what kvferry refuses.

``KVArgs`` holds raw integer pointers: ``kv_data_ptrs/lens/item_lens`` (MHA as
``[K_0..K_{L-1}, V_0..V_{L-1}]``, MLA one latent buffer per layer, the draft
model's entries appended, ``num_draft_entries`` of them), the aux regions
``aux_data_ptrs/lens/item_lens`` (SGLang's ``MetadataBuffers``: about 13
host-memory tensors sharing one row index), ``page_size``, and for MHA
``kv_head_num``/``total_kv_head_num``. There is no head dim and no draft head
count: the head dim follows from the item size and the dtype
(``kv_cache_dtype_str``); the draft's heads from its item size, taking the
target's head dim (EAGLE drafts share it).

State pools. SGLang's ``setup_state_kv_args`` appends one component per
state type (``state_types``, with ``state_data_ptrs/lens/item_lens``): each
becomes a kvferry state pool (:func:`states_from_kv_args`) whose items move
as SGLang's own backends move that type's generic components, item ``i`` of
prefill's indices to item ``i`` of decode's in every buffer, with the last
chunk. Sharded over the TP ranks: Mamba state (heads), and an MHA model's
sliding-window KV and block scales; replicated (one prefill rank sends):
DSA's indexer pages, and every state of an MLA model.
Page-indexed states (``swa``, ``dsa``, ``block_scale*``) pair the shorter
of the two index lists, as SGLang's backends do; slot- and row-indexed ones
must match. Refused, naming the type and why: ``dsa_tail`` and the MiniMax
states (their indices are not item ids: ring segments, layer groups),
DeepSeek-V4's (its KV pools are refused as a whole), Qwen's QSA state (not
verified); a hybrid MLA backend; and, at the handshake, a sharded state
between different TP sizes without a slice axis.

Aux rows. Every aux region is handed to kvferry as it is
(:func:`aux_regions_from_kv_args`, one :class:`~transfer.pools.RawAuxRegion`
each): kvferry registers them and moves a request slot's row of each region
as one descriptor, no copy in between.
"""

from __future__ import annotations

from bootstrap.messages import PoolRole
from transfer.pools import MHAPool, MLAPool, RawAuxRegion, RawPool, head_dim_of, pool_from_pointers

# SGLang's kv_cache_dtype_str -> torch dtype name.
_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "bf16": "bfloat16", "fp16": "float16",
           "auto": ""}


class UnsupportedSetup(ValueError):
    """An SGLang set-up kvferry cannot serve; raised at start-up, never mid-transfer."""


def check_supported(args, server_args) -> None:
    """Raise :class:`UnsupportedSetup` naming the first set-up kvferry does not serve."""
    problems = []
    state_types = [str(getattr(s, "value", s)) for s in getattr(args, "state_types", None) or []]
    if len(state_types) != len(getattr(args, "state_data_ptrs", None) or []):
        problems.append(f"state buffers that do not match the state types ({', '.join(state_types) or 'none'})")
    refused = [t for t in state_types if t not in STATE_KINDS]
    if refused:
        why = "; ".join(f"{t}: {_REFUSED_STATES[t]}" for t in refused if t in _REFUSED_STATES)
        problems.append(f"state pools of type {', '.join(refused)} (kvferry moves "
                        f"{', '.join(sorted(STATE_KINDS))}{'; ' + why if why else ''}; see docs/sglang.md)")
    if getattr(args, "mla_compression_ratios", None):
        problems.append("DeepSeek-V4's compressed KV pools (buffers organised by compression ratio, not by layer)")
    if getattr(args, "is_hybrid_mla_backend", False):
        problems.append("a hybrid MLA backend (Mamba state beside an MLA KV pool)")
    if int(getattr(server_args, "pp_size", 1) or 1) > 1:
        problems.append(f"pipeline parallelism (--pp-size {server_args.pp_size})")
    for name in ("attn_cp_size", "dcp_size"):
        if int(getattr(server_args, name, 1) or 1) > 1:
            problems.append(f"context parallelism ({name} {getattr(server_args, name)})")
    if getattr(args, "host_kv_data_ptrs", None):
        problems.append("host KV destinations")
    if getattr(server_args, "disaggregation_decode_enable_offload_kvcache", False):
        problems.append("decode KV offload")
    layout = getattr(args, "kv_layout", None)
    if layout not in (None, "nhd", "hnd", "NHD", "HND"):
        problems.append(f"KV layout {layout!r}")
    if problems:
        raise UnsupportedSetup("kvferry transfer backend: unsupported SGLang set-up: " + "; ".join(problems)
                               + ". Use --disaggregation-transfer-backend mooncake for it.")


#: SGLang state type -> whether its index lists must match item for item (slot- and row-indexed)
#: rather than pair the shorter (page-indexed: SGLang's backends let a window's edge differ by a page)
STATE_KINDS = {"mamba": True, "swa": False, "dsa": False, "block_scale": False, "block_scale_swa": False}
#: state types that are the same on every attention TP rank whatever the model (else: only an MLA model's)
_REPLICATED = {"dsa"}
#: why the other state types are refused
_REFUSED_STATES = {
    "dsa_tail": "its indices encode ring segments, not item ids",
    "minimax_index_k": "SGLang moves it by layer groups of its own", "minimax_dense_kv": "SGLang moves it by "
    "layer groups of its own",
    "swa_ring": "DeepSeek-V4 state", "c128_state": "DeepSeek-V4 state", "request_row": "DeepSeek-V4 state",
    "qsa_pending": "not verified with SGLang's QSA pool", "qsa_compressed": "not verified with SGLang's QSA pool"}


def states_from_kv_args(args, *, is_mla: bool, device: str = "cpu", kv_heads: int = 0, attn_tp: int = 1) -> list:
    """SGLang's state components as kvferry state pools
    (:class:`~transfer.state_pools.StatePool`), in ``state_types`` order, with
    the slice axes SGLang's backends reslice between TP sizes: a Mamba
    tensor's (``state_dim_per_tensor``, ``state_slice_outer_counts``,
    ``state_conv_shard_groups``; dim 0: the same on every rank) and the KV
    heads of an MHA sliding-window page or of a page's MXFP8 block scales
    (``kv_heads`` per rank; its token rows for SGLang's ``nhd`` layout)."""
    from transfer.state_pools import RawStatePool, state_pool_from_pointers

    out = []
    types = [str(getattr(s, "value", s)) for s in getattr(args, "state_types", None) or []]
    if not types:
        return out  # no state pools (whatever state_data_ptrs holds)
    if not len(types) == len(args.state_data_ptrs) == len(args.state_data_lens) == len(args.state_item_lens):
        raise UnsupportedSetup(f"KVArgs: {len(types)} state_types, {len(args.state_data_ptrs)} state_data_ptrs, "
                               f"{len(args.state_data_lens)} state_data_lens and {len(args.state_item_lens)} "
                               "state_item_lens (one of each per state pool)")
    for k, (kind, ptrs, lens, items) in enumerate(zip(types, args.state_data_ptrs, args.state_data_lens,
                                                      args.state_item_lens, strict=True)):
        replicated = kind != "mamba" and (is_mla or kind in _REPLICATED)
        slicing = () if replicated else _slicing(args, k, kind, len(ptrs), kv_heads, attn_tp)
        try:
            raw = RawStatePool(kind=kind, addrs=list(ptrs), nbytes=list(lens), item_bytes=list(items),
                               sharding="replicated" if replicated else "sharded", exact=STATE_KINDS[kind],
                               device=device, slicing=slicing)
        except ValueError as exc:
            raise UnsupportedSetup(f"KVArgs: {exc}") from None
        out.append(state_pool_from_pointers(raw))
    return out


def _slicing(args, k: int, kind: str, num_buffers: int, kv_heads: int, attn_tp: int) -> tuple:
    """Per buffer of state component ``k``: (slice dim, rows before it, sub-blocks) or None."""
    if kind == "mamba":
        dims = _entry(getattr(args, "state_dim_per_tensor", None), k)
        outers = _entry(getattr(args, "state_slice_outer_counts", None), k)
        groups = _entry(getattr(args, "state_conv_shard_groups", None), k)
        if not dims:
            return ()
        out = []
        for j in range(num_buffers):
            dim = int(dims[j]) if j < len(dims) else 0
            sub = groups[j] if groups and j < len(groups) and groups[j] else ()
            if sub and sum(sub) != dim * attn_tp:  # as SGLang: sub-blocks only when they cover the whole axis
                sub = ()
            out.append((dim, int(outers[j]) if outers and j < len(outers) else 1, tuple(sub)) if dim else None)
        return tuple(out)
    if kind in ("swa", "block_scale") and kv_heads > 0:  # pages of KV heads (a block scale: per 32 elements)
        layout = str(getattr(args, "swa_kv_cache_layout" if kind == "swa" else "kv_layout", None) or "nhd").lower()
        if layout == "nhd":
            return tuple((kv_heads, int(args.page_size), ()) for _ in range(num_buffers))
        if layout == "hnd":
            return tuple((kv_heads, 1, ()) for _ in range(num_buffers))
    return ()


def _entry(table, k: int):
    return table[k] if table and k < len(table) else None


def torch_dtype_name(args) -> str:
    """The pools' element type; ``uint8`` (head dims in bytes) when SGLang names none."""
    import torch

    text = str(getattr(args, "kv_cache_dtype_str", "") or "").removeprefix("torch.")
    name = _DTYPES.get(text, text)
    return name if name and isinstance(getattr(torch, name, None), torch.dtype) else "uint8"


def device_of(server_args, args) -> str:
    device = str(getattr(server_args, "device", "cpu") or "cpu")
    if device.startswith("cuda") or device == "gpu":
        return f"cuda:{int(getattr(args, 'gpu_id', 0) or 0)}"
    return "cpu"


def kv_heads_of_model(server_args, attn_tp_size: int) -> tuple[int, int]:
    """(KV heads per rank, KV heads of the model) as SGLang's pools size them
    (``model_config.get_num_kv_heads(attn_tp)``: the model's heads split over
    the attention TP ranks, at least one each), from the model's config.
    SGLang's decode sets ``KVArgs.kv_head_num`` only after the manager is built
    (and only with staging), so a decode rank reads the model instead."""
    from sglang.srt.configs.model_config import ModelConfig

    total = int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())
    return max(1, total // max(1, attn_tp_size)), total


def pools_from_kv_args(args, *, is_mla: bool, device: str = "cpu",
                       kv_heads: tuple[int, int] | None = None) -> list[MHAPool | MLAPool]:
    """The target pool and, when SGLang appended draft entries, the draft pool.
    ``kv_heads``: (per rank, of the model), for MHA when ``KVArgs`` carries no
    ``kv_head_num`` (SGLang's decode; see :func:`kv_heads_of_model`)."""
    import torch

    dtype = torch_dtype_name(args)
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    ptrs, lens, items = list(args.kv_data_ptrs), list(args.kv_data_lens), list(args.kv_item_lens)
    num_draft = int(getattr(args, "num_draft_entries", 0) or 0)
    num_target = len(ptrs) - num_draft
    if num_target <= 0:
        raise UnsupportedSetup(f"KVArgs: {len(ptrs)} KV buffers, {num_draft} of them draft: no target pool")
    layout = "hnd" if str(getattr(args, "kv_layout", "") or "").lower() == "hnd" else "nhd"
    page_size = int(args.page_size)
    common = dict(attention="mla" if is_mla else "mha", page_size=page_size, dtype=dtype, device=device,
                  layout=layout if not is_mla else "nhd")
    heads = total = 1
    if not is_mla:
        if getattr(args, "kv_head_num", None):
            heads, total = int(args.kv_head_num), int(getattr(args, "total_kv_head_num", 0) or args.kv_head_num)
        elif kv_heads is not None:
            heads, total = kv_heads
        else:
            raise UnsupportedSetup("KVArgs carries no kv_head_num, and the model's KV heads are unknown")
    target = RawPool(addrs=ptrs[:num_target], nbytes=lens[:num_target], page_bytes=items[:num_target],
                     num_kv_heads=heads, total_kv_heads=total, role=PoolRole.TARGET, **common)
    pools = [pool_from_pointers(target)]
    if num_draft:
        draft_heads = draft_total = 1
        if not is_mla:
            head_dim = head_dim_of(items[0], page_size, heads, itemsize)
            draft_heads = items[num_target] // (page_size * head_dim * itemsize)
            if draft_heads < 1 or draft_heads * page_size * head_dim * itemsize != items[num_target]:
                raise UnsupportedSetup(f"KVArgs: draft item size {items[num_target]} is not a whole number of "
                                       f"heads of the target's head dim {head_dim}")
            draft_total = max(draft_heads, draft_heads * total // heads)
        draft = RawPool(addrs=ptrs[num_target:], nbytes=lens[num_target:], page_bytes=items[num_target:],
                        num_kv_heads=draft_heads, total_kv_heads=draft_total, role=PoolRole.DRAFT, **common)
        pools.append(pool_from_pointers(draft))
    return pools


def aux_regions_from_kv_args(args) -> list[RawAuxRegion]:
    """SGLang's aux regions (``aux_data_ptrs/lens/item_lens``), in order, as
    raw regions sharing one row index; raises :class:`UnsupportedSetup` when
    their row counts differ."""
    ptrs = list(getattr(args, "aux_data_ptrs", None) or [])
    if not ptrs:
        return []
    lens, items = list(args.aux_data_lens), list(args.aux_item_lens)
    if not len(ptrs) == len(lens) == len(items):
        raise UnsupportedSetup(f"KVArgs: {len(ptrs)} aux_data_ptrs, {len(lens)} aux_data_lens and {len(items)} "
                               "aux_item_lens (one of each per region)")
    slots = {n // i for n, i in zip(lens, items, strict=True)}
    if len(slots) != 1 or any(n % i for n, i in zip(lens, items, strict=True)):
        raise UnsupportedSetup(f"KVArgs: aux regions of different slot counts ({sorted(slots)})")
    num_slots = slots.pop()
    return [RawAuxRegion(addr=p, row_bytes=i, num_rows=num_slots) for p, i in zip(ptrs, items, strict=True)]
