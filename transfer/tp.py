"""Tensor-parallel maths: which prefill ranks feed which decode rank. Pure.

An MHA pool with ``total_heads`` KV heads is split by heads across ``tp``
ranks: ``total_heads / tp`` heads each when ``total_heads >= tp``, otherwise
(GQA with fewer KV heads than ranks) each head is replicated on
``tp / total_heads`` consecutive ranks. An MLA pool is identical on every rank,
so exactly one prefill rank sends it to each decode rank.

Every prefill rank must reach a terminal state for every room, so each prefill
rank also has a *home* decode rank that always contacts it, even when it sends
nothing (its assignments then say so explicitly).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRange:
    start: int
    count: int


@dataclass(frozen=True)
class HeadSlice:
    """Heads that one prefill rank sends to one decode rank, as offsets into
    each side's local heads."""

    prefill_rank: int
    src_head_offset: int
    dst_head_offset: int
    num_heads: int


def check_tp(total_heads: int, tp_size: int) -> None:
    """Raise ValueError unless ``total_heads`` can be split over ``tp_size``."""
    if tp_size <= 0 or total_heads <= 0:
        raise ValueError(f"tp_size and total_heads must be > 0, got {tp_size}, {total_heads}")
    if total_heads >= tp_size and total_heads % tp_size:
        raise ValueError(f"{total_heads} KV heads do not divide over tp_size {tp_size}")
    if total_heads < tp_size and tp_size % total_heads:
        raise ValueError(f"tp_size {tp_size} is not a multiple of {total_heads} KV heads")


def heads_of(rank: int, tp_size: int, total_heads: int) -> HeadRange:
    """The global KV heads that TP rank ``rank`` holds."""
    check_tp(total_heads, tp_size)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} not in [0, {tp_size})")
    if total_heads >= tp_size:
        per = total_heads // tp_size
        return HeadRange(rank * per, per)
    return HeadRange(rank // (tp_size // total_heads), 1)


def check_tp_pair(prefill_tp: int, decode_tp: int) -> None:
    """Raise ValueError unless one TP size divides the other."""
    big, small = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if small <= 0 or big % small:
        raise ValueError(f"prefill tp_size {prefill_tp} and decode tp_size {decode_tp}: neither divides the other")


def mha_sources(decode_rank: int, prefill_tp: int, decode_tp: int, total_heads: int) -> tuple[HeadSlice, ...]:
    """The head slices that decode rank ``decode_rank`` receives, one per
    feeding prefill rank, covering its heads exactly once. Where several
    prefill ranks hold a head (replication), the choice spreads decode ranks
    over the replicas."""
    check_tp_pair(prefill_tp, decode_tp)
    want = heads_of(decode_rank, decode_tp, total_heads)
    slices: list[HeadSlice] = []
    for head in range(want.start, want.start + want.count):
        holders = [p for p in range(prefill_tp) if _holds(p, prefill_tp, total_heads, head)]
        src = holders[decode_rank % len(holders)]
        src_range = heads_of(src, prefill_tp, total_heads)
        last = slices[-1] if slices else None
        if last is not None and last.prefill_rank == src and \
                last.src_head_offset + last.num_heads == head - src_range.start:
            slices[-1] = HeadSlice(src, last.src_head_offset, last.dst_head_offset, last.num_heads + 1)
        else:
            slices.append(HeadSlice(src, head - src_range.start, head - want.start, 1))
    return tuple(slices)


def _holds(rank: int, tp_size: int, total_heads: int, head: int) -> bool:
    r = heads_of(rank, tp_size, total_heads)
    return r.start <= head < r.start + r.count


def mla_source(decode_rank: int, prefill_tp: int, decode_tp: int) -> int:
    """The one prefill rank that sends an MLA pool to ``decode_rank``."""
    check_tp_pair(prefill_tp, decode_tp)
    return decode_rank % prefill_tp


def home_decode_rank(prefill_rank: int, prefill_tp: int, decode_tp: int) -> int:
    """The decode rank that always contacts ``prefill_rank`` for a room."""
    check_tp_pair(prefill_tp, decode_tp)
    return prefill_rank % decode_tp


def contacted_prefill_ranks(decode_rank: int, prefill_tp: int, decode_tp: int,
                            sending: set[int]) -> tuple[int, ...]:
    """All prefill ranks that ``decode_rank`` sends a request to: the ones in
    ``sending`` plus those whose home it is."""
    homes = {p for p in range(prefill_tp) if home_decode_rank(p, prefill_tp, decode_tp) == decode_rank}
    return tuple(sorted(sending | homes))


@dataclass(frozen=True)
class PoolShape:
    """What routing needs to know of a pool present on both sides."""

    role: object  # bootstrap.messages.PoolRole
    is_mla: bool
    total_heads: int


def room_routes(decode_rank: int, prefill_tp: int, decode_tp: int,
                pools: tuple[PoolShape, ...]) -> dict[int, dict[object, HeadSlice | None]]:
    """For one decode rank: every prefill rank it contacts for a room, and per
    pool what that rank sends (a HeadSlice, or None for "sends nothing")."""
    sending: dict[int, dict[object, HeadSlice | None]] = {}
    for pool in pools:
        if pool.is_mla:
            src = mla_source(decode_rank, prefill_tp, decode_tp)
            sending.setdefault(src, {})[pool.role] = HeadSlice(src, 0, 0, 1)
        else:
            for s in mha_sources(decode_rank, prefill_tp, decode_tp, pool.total_heads):
                sending.setdefault(s.prefill_rank, {})[pool.role] = s
    routes = {}
    for p in contacted_prefill_ranks(decode_rank, prefill_tp, decode_tp, set(sending)):
        routes[p] = {pool.role: sending.get(p, {}).get(pool.role) for pool in pools}
    return routes


def num_requests(prefill_rank: int, prefill_tp: int, decode_tp: int, pools: tuple[PoolShape, ...]) -> int:
    """How many decode ranks contact ``prefill_rank`` for one room."""
    return sum(prefill_rank in room_routes(d, prefill_tp, decode_tp, pools) for d in range(decode_tp))
