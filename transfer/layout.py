"""Handshake compatibility of two ranks' pools. Pure.

:func:`check_compatible` compares what must match between a prefill rank and
a decode rank (per pool role: attention kind, dtype, page size, layer count,
KV heads, head dim, K/V packing and page interior; the TP pair; the aux regions' number and row sizes; the state
pools' kinds, buffers and item sizes, and for a sharded state between different TP sizes, slice axes that
reslice) and raises
:class:`~transfer.errors.IncompatibleLayoutError` naming the first field that
differs. :func:`layout_fingerprint` hashes the same fields, for logs and for
storage keys.
"""

from __future__ import annotations

import hashlib

import enum

from bootstrap.messages import KVLayout, PageLayout, PoolDescriptor, PoolRole, RankInfo
from transfer import tp
from transfer.errors import IncompatibleLayoutError, IncompatibleTransportError
from transfer.state_slices import check_slices

_POOL_FIELDS = ("attention", "dtype", "itemsize", "page_size", "num_layers", "total_kv_heads", "head_dim",
                "page_layout")


def _value(pool: PoolDescriptor, name: str):
    v = getattr(pool, name)
    return v.value if isinstance(v, enum.Enum) else v


def check_compatible(local: RankInfo, remote: RankInfo, *, allow_missing_draft: bool = False,
                     local_is_prefill: bool) -> None:
    """Raise IncompatibleLayoutError unless ``local`` and ``remote`` can exchange
    KV. ``allow_missing_draft`` lets a decode rank with a draft pool face a
    prefill rank without one (the draft pool is then left to the scheduler)."""
    prefill, decode = (local, remote) if local_is_prefill else (remote, local)

    def mismatch(field, p, d, detail=""):
        lv, rv = (p, d) if local_is_prefill else (d, p)
        raise IncompatibleLayoutError(field, lv, rv, detail=detail)

    if prefill.transport != decode.transport:
        here, there = (prefill, decode) if local_is_prefill else (decode, prefill)
        roles = ("prefill", "decode") if local_is_prefill else ("decode", "prefill")
        raise IncompatibleTransportError(
            "transport", here.transport, there.transport,
            detail=f"{roles[1]} rank {there.node_id} dp {there.dp_rank} tp {there.tp_rank}/{there.tp_size} "
                   f"uses transport {there.transport}, this {roles[0]} rank uses {here.transport}; "
                   "both sides of a room must use the same one (EngineConfig.backend, KVFERRY_BACKEND)")

    try:
        tp.check_tp_pair(prefill.tp_size, decode.tp_size)
    except ValueError as exc:
        mismatch("tp_size", prefill.tp_size, decode.tp_size, str(exc))
    for role in PoolRole:
        p, d = prefill.pool(role), decode.pool(role)
        if p is None and d is None:
            continue
        if p is None or d is None:
            if role is PoolRole.DRAFT and p is None and allow_missing_draft:
                continue
            mismatch(f"{role.value} pool", "present" if p else "absent", "present" if d else "absent",
                     "a pool on one side only" + ("" if role is PoolRole.TARGET else
                                                  "; allow_missing_draft serves the target alone"))
        fused = p.kv_layout is not KVLayout.SPLIT
        if p.kv_layout is not d.kv_layout or (fused and p.page_layout is not d.page_layout):
            mismatch(f"{role.value}.kv_layout", layout_name(p), layout_name(d),
                     "K/V packing or page interior differ, which no plan bridges (page strides may differ: "
                     "cross-layer blocks and per-layer buffers are bridged)")
        for name in _POOL_FIELDS:
            if _value(p, name) != _value(d, name):
                mismatch(f"{role.value}.{name}", _value(p, name), _value(d, name))
        if p.attention.value == "mha":
            for side, pool, size in (("prefill", p, prefill.tp_size), ("decode", d, decode.tp_size)):
                try:
                    expect = tp.heads_of(0, size, pool.total_kv_heads).count
                except ValueError as exc:
                    mismatch(f"{role.value}.total_kv_heads", p.total_kv_heads, d.total_kv_heads, str(exc))
                if pool.num_kv_heads != expect:
                    raise IncompatibleLayoutError(
                        f"{role.value}.num_kv_heads", pool.num_kv_heads, expect,
                        detail=f"{side} holds {pool.num_kv_heads} heads but tp_size {size} "
                               f"with {pool.total_kv_heads} heads gives {expect} per rank")
    _check_states(prefill, decode, mismatch)
    if bool(prefill.aux) != bool(decode.aux):
        mismatch("aux", bool(prefill.aux), bool(decode.aux), "an aux buffer on one side only")
    if len(prefill.aux) != len(decode.aux):
        mismatch("aux.num_regions", len(prefill.aux), len(decode.aux), "region i is sent to region i")
    for i, (p, d) in enumerate(zip(prefill.aux, decode.aux, strict=True)):
        if p.slot_bytes != d.slot_bytes:
            name = "aux" if len(prefill.aux) == 1 else f"aux[{i}]"  # one region: named as before regions came
            mismatch(f"{name}.slot_bytes", p.slot_bytes, d.slot_bytes, f"aux region {i}'s rows differ in size")


def _check_states(prefill: RankInfo, decode: RankInfo, mismatch) -> None:
    """State pool ``i`` goes to state pool ``i``: the same kinds in the same
    order, the same buffers, items of one size (a sharded state between
    different TP sizes: slice axes that reslice, :func:`~transfer.state_slices.check_slices`)."""
    kinds = [s.kind for s in prefill.states], [s.kind for s in decode.states]
    if kinds[0] != kinds[1]:
        mismatch("states", ",".join(kinds[0]) or "none", ",".join(kinds[1]) or "none",
                 "state pool i is sent to state pool i: both sides need the same state pools in the same order")
    for p, d in zip(prefill.states, decode.states, strict=True):
        for name in ("sharding", "exact"):
            if _value(p, name) != _value(d, name):
                mismatch(f"states.{p.kind}.{name}", _value(p, name), _value(d, name))
        if len(p.buffers) != len(d.buffers):
            mismatch(f"states.{p.kind}.num_buffers", len(p.buffers), len(d.buffers))
        sliced = p.sharding.value == "sharded" and prefill.tp_size != decode.tp_size
        if sliced and not any(b.slice_dim for b in (*p.buffers, *d.buffers)):
            mismatch(f"states.{p.kind}.tp_size", prefill.tp_size, decode.tp_size,
                     f"state {p.kind} is sharded over the TP ranks and kvferry cannot reslice it: its buffers name "
                     "no slice axis")
        for i, (pb, db) in enumerate(zip(p.buffers, d.buffers, strict=True)):
            if not sliced and pb.item_bytes != db.item_bytes:
                mismatch(f"states.{p.kind}[{i}].item_bytes", pb.item_bytes, db.item_bytes,
                         f"buffer {i} of state {p.kind}: its items differ in size")
            if sliced:
                try:
                    check_slices(pb, db, prefill.tp_size, decode.tp_size, f"buffer {i} of state {p.kind}")
                except ValueError as exc:
                    mismatch(f"states.{p.kind}.tp_size", prefill.tp_size, decode.tp_size,
                             f"state {p.kind} is sharded over the TP ranks and kvferry cannot reslice it: {exc}")


def layout_name(pool: PoolDescriptor) -> str:
    """A pool's memory layout in words, for errors: kvferry's own (``split
    nhd``, ``split hnd``, ``mla``) or vLLM's (``vLLM CPU (LBHNC, K rows then
    V rows)``, ``vLLM LBNHC``, ``vLLM BLHNC``...: ``BL`` where layers share
    a block, that is where the page stride exceeds the page)."""
    if pool.attention.value == "mla":
        return "mla"
    if pool.kv_layout is KVLayout.SPLIT:
        return f"split {pool.page_layout.value}"
    name = ("LB" if pool.dense else "BL") + ("HNC" if pool.page_layout is PageLayout.HND else "NHC")
    if pool.kv_layout is KVLayout.FUSED_ROWS:
        return f"vLLM CPU ({name}, K rows then V rows)"
    return f"vLLM {name}"


def layout_fingerprint(pool: PoolDescriptor) -> str:
    """A short hash of the fields that make two pools' bytes comparable."""
    text = "|".join(f"{n}={_value(pool, n)}" for n in ("role",) + _POOL_FIELDS if n != "role")
    if pool.kv_layout is not KVLayout.SPLIT:  # split pools hash as before fused ones came
        text += f"|kv_layout={pool.kv_layout.value}"
    return hashlib.sha256(f"{pool.role.value}|{text}".encode()).hexdigest()[:16]
