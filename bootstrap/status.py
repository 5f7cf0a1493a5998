"""The status view of a bootstrap server: what ``python -m bootstrap status``
asks for and prints.

:class:`Status` -> :class:`StatusReply`: every registered rank with its
pools' layouts (no addresses) and the age of its last registration, and the
server's settings and counters. Pure: importing this module registers the
two messages with the codec (the server and the client import it).

**Derived from the descriptors.** :class:`RankStatus` and :class:`PoolSummary`
hold the fields of :class:`~bootstrap.messages.RankInfo` and
:class:`~bootstrap.descriptors.PoolDescriptor`, read off those dataclasses
when this module is imported (same names, types and defaults), less the ones
:data:`WITHHELD` names; ``of`` copies the values by name. So a field added to
a descriptor is in the status too, unless it is added to :data:`WITHHELD`.

**Wire.** A view field with a default is left out of the encoding while it
holds it (``omit_default``, see :mod:`bootstrap.codec`): a descriptor field
added with a default adds nothing to the status of a rank that holds the
default, and its value reaches the status reply where it differs (a client
of an older protocol then refuses that reply, naming the field). A field
added without a default, a protocol version bump, changes the reply too.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import asdict, dataclass, field

from bootstrap.codec import message, struct
from bootstrap.descriptors import OMIT_DEFAULT
from bootstrap.messages import AttentionKind, KVLayout, PoolDescriptor, RankInfo, StatePoolDescriptor

#: At most this many ranks are listed in a status reply (the rest are counted).
MAX_STATUS_RANKS = 4096

#: The descriptor fields the status view leaves out: addresses (the buffers of
#: a pool, a rank's aux and staging regions) and ``itemsize`` (the dtype says
#: it). ``RankInfo.pools`` is not left out but summarised (:class:`PoolSummary`).
WITHHELD: dict[type, frozenset[str]] = {
    PoolDescriptor: frozenset({"buffers", "itemsize"}),
    RankInfo: frozenset({"aux", "staging"}),
    StatePoolDescriptor: frozenset({"buffers"}),
}


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


def _fields_of(descriptor: type, *, declared: tuple[str, ...] = ()):
    """A frozen, keyword-only dataclass with ``descriptor``'s fields less
    :data:`WITHHELD` and ``declared`` (which the view declares itself), for a
    view to inherit; its ``_copied(value)`` gives those fields of a
    descriptor, by name."""
    hints = typing.get_type_hints(descriptor)
    specs = []
    for f in dataclasses.fields(descriptor):
        if f.name in WITHHELD[descriptor] or f.name in declared:
            continue
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            specs.append((f.name, hints[f.name]))
        else:
            specs.append((f.name, hints[f.name], dataclasses.field(
                default=f.default, default_factory=f.default_factory, metadata=OMIT_DEFAULT)))
    names = tuple(spec[0] for spec in specs)

    def _copied(cls, value) -> dict:
        return {name: getattr(value, name) for name in names}

    base = dataclasses.make_dataclass(f"{descriptor.__name__}Fields", specs, frozen=True, kw_only=True,
                                      namespace={"_copied": classmethod(_copied)})
    base.__module__ = __name__
    return base


@message("status")
@dataclass(frozen=True)
class Status:
    """Ask for everything registered (``python -m bootstrap status``)."""


@struct
@dataclass(frozen=True, kw_only=True)
class PoolSummary(_fields_of(PoolDescriptor)):
    """A pool's layout: the fields of its :class:`PoolDescriptor` but the
    :data:`WITHHELD` ones (no buffer addresses)."""

    @classmethod
    def of(cls, pool: PoolDescriptor) -> PoolSummary:
        """The summary of ``pool``."""
        return cls(**cls._copied(pool))


@struct
@dataclass(frozen=True, kw_only=True)
class StateSummary(_fields_of(StatePoolDescriptor)):
    """A state pool: the fields of its :class:`StatePoolDescriptor` but the
    buffers (their addresses), with their number and one item's bytes."""

    num_buffers: int
    item_bytes: int

    @classmethod
    def of(cls, state: StatePoolDescriptor) -> StateSummary:
        return cls(**cls._copied(state), num_buffers=len(state.buffers), item_bytes=state.item_bytes)


@struct
@dataclass(frozen=True, kw_only=True)
class RankStatus(_fields_of(RankInfo, declared=("pools", "states"))):
    """One registered rank: the fields of its :class:`RankInfo` but the
    :data:`WITHHELD` ones, with ``pools`` and ``states`` summarised;
    ``age_s``: seconds since it last registered."""

    age_s: float
    pools: tuple[PoolSummary, ...]
    states: tuple[StateSummary, ...] = field(default=(), metadata=OMIT_DEFAULT)

    @classmethod
    def of(cls, rank: RankInfo, age_s: float) -> RankStatus:
        """The status of ``rank``, last registered ``age_s`` seconds ago."""
        return cls(**cls._copied(rank), age_s=age_s, pools=tuple(PoolSummary.of(p) for p in rank.pools),
                   states=tuple(StateSummary.of(s) for s in rank.states))


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
    kv = "" if pool.kv_layout is KVLayout.SPLIT else f" {pool.kv_layout.value}"
    return (f"{pool.role.value} {pool.attention.value} {pool.dtype} page {pool.page_size} x {pool.num_pages} pages "
            f"{pool.num_layers} layers {heads} x {pool.head_dim} {pool.page_layout.value}{kv}")


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
                     r.session, r.control_endpoint, "; ".join([*(_pool_text(p) for p in r.pools),
                                                               *(f"state {x.kind} {x.sharding.value} x {x.num_buffers} "
                                                                 f"buffers" for x in r.states)])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in rows]
    if reply.num_omitted:
        lines.append(f"... and {reply.num_omitted} more ranks (a reply lists at most {MAX_STATUS_RANKS})")
    return "\n".join(lines)
