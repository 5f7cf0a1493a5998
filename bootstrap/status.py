"""The status view of a bootstrap server: what ``python -m bootstrap status``
asks for and prints.

:class:`Status` -> :class:`StatusReply`: every registered rank with its
pools' layouts (no buffer addresses) and the age of its last registration,
and the server's settings and counters. Pure: importing this module registers
the two messages with the codec (the server and the client import it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from bootstrap.codec import message, struct
from bootstrap.messages import AttentionKind, PageLayout, PoolDescriptor, PoolRole

#: At most this many ranks are listed in a status reply (the rest are counted).
MAX_STATUS_RANKS = 4096


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


@message("status")
@dataclass(frozen=True)
class Status:
    """Ask for everything registered (``python -m bootstrap status``)."""


@struct
@dataclass(frozen=True)
class PoolSummary:
    """A pool's layout without its buffer addresses."""

    role: PoolRole
    attention: AttentionKind
    dtype: str
    page_size: int
    num_pages: int
    num_layers: int
    num_kv_heads: int
    total_kv_heads: int
    head_dim: int
    page_layout: PageLayout

    @classmethod
    def of(cls, pool: PoolDescriptor) -> "PoolSummary":
        return cls(role=pool.role, attention=pool.attention, dtype=pool.dtype, page_size=pool.page_size,
                   num_pages=pool.num_pages, num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads,
                   total_kv_heads=pool.total_kv_heads, head_dim=pool.head_dim, page_layout=pool.page_layout)


@struct
@dataclass(frozen=True)
class RankStatus:
    """One registered rank; ``age_s``: seconds since it last registered."""

    node_id: str
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    session: str
    control_endpoint: str
    age_s: float
    pools: tuple[PoolSummary, ...]


@message("status_reply")
@dataclass(frozen=True)
class StatusReply:
    """The registry as the server sees it: ranks ordered by (node, DP, TP),
    at most :data:`MAX_STATUS_RANKS` of them (``num_omitted`` counts the
    rest), and the server's settings and counters."""

    uptime_s: float
    rank_ttl_s: float
    node_grace_s: float
    num_requests: int
    num_errors: int
    num_unauthenticated: int
    num_expired: int
    ranks: tuple[RankStatus, ...]
    num_omitted: int

    def __post_init__(self) -> None:
        _require(len(self.ranks) <= MAX_STATUS_RANKS, f"ranks holds more than {MAX_STATUS_RANKS} entries")


def _plain(value):
    """``asdict`` output with Enums as their values (for JSON)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "value", value)


def status_json(reply: StatusReply, address: str) -> str:
    """The reply as one JSON object (``address``: the server asked)."""
    return json.dumps({"address": address, **_plain(asdict(reply))}, sort_keys=True)


def _pool_text(pool: PoolSummary) -> str:
    heads = f"{pool.num_kv_heads}/{pool.total_kv_heads} heads" if pool.attention is AttentionKind.MHA else "latent"
    return (f"{pool.role.value} {pool.attention.value} {pool.dtype} page {pool.page_size} x {pool.num_pages} pages "
            f"{pool.num_layers} layers {heads} x {pool.head_dim} {pool.page_layout.value}")


def status_table(reply: StatusReply, address: str) -> str:
    """The reply as a header line and one line per rank, for people."""
    nodes = {r.node_id for r in reply.ranks}
    lines = [f"bootstrap {address}: up {reply.uptime_s:.1f} s, {len(reply.ranks) + reply.num_omitted} ranks "
             f"on {len(nodes)}{'+' if reply.num_omitted else ''} nodes (rank TTL {reply.rank_ttl_s:g} s, "
             f"node grace {reply.node_grace_s:g} s; {reply.num_requests} requests, {reply.num_errors} errors, "
             f"{reply.num_unauthenticated} unauthenticated, {reply.num_expired} expired)"]
    rows = [("NODE", "DP", "TP", "AGE_S", "SESSION", "CONTROL", "POOLS")]
    for r in reply.ranks:
        rows.append((r.node_id, f"{r.dp_rank}/{r.dp_size}", f"{r.tp_rank}/{r.tp_size}", f"{r.age_s:.1f}",
                     r.session, r.control_endpoint, "; ".join(_pool_text(p) for p in r.pools)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    if reply.num_omitted:
        lines.append(f"... and {reply.num_omitted} more ranks (a reply lists at most {MAX_STATUS_RANKS})")
    return "\n".join(lines)
