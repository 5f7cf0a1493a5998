"""bootstrap.status: the server's status reply, derived from the
descriptors, as a table and as JSON."""

from __future__ import annotations

import dataclasses
import json
import typing

import msgpack
import pytest

import bootstrap.messages as bm
from bootstrap import codec
from bootstrap.status import (MAX_STATUS_RANKS, WITHHELD, PoolSummary, RankStatus, StateSummary, StatusReply,
                              status_json, status_table)

from ._fixtures import make_pool, make_rank


def _reply(num_omitted: int = 0) -> StatusReply:
    mla = make_pool(attention=bm.AttentionKind.MLA, num_kv_heads=1, total_kv_heads=1, head_dim=576,
                    dtype="float8_e4m3fn", itemsize=1, page_size=64)
    gqa = make_pool(role=bm.PoolRole.DRAFT, num_kv_heads=2, total_kv_heads=8, base=0x6000_0000_0000)
    rank = make_rank(pools=(mla, gqa))
    status = RankStatus.of(rank, age_s=1.25)
    return StatusReply(uptime_s=30.0, rank_ttl_s=15.0, node_grace_s=4.0, num_requests=7, num_errors=1,
                       num_unauthenticated=0, num_expired=3, ranks=(status,), num_omitted=num_omitted)


def test_pool_summary_keeps_the_layout():
    pool = make_pool(num_kv_heads=2, total_kv_heads=8, page_size=32, num_pages=10)
    s = PoolSummary.of(pool)
    assert (s.role, s.attention, s.dtype, s.page_size, s.num_pages, s.num_kv_heads, s.total_kv_heads) == (
        pool.role, pool.attention, pool.dtype, 32, 10, 2, 8)


def test_json_is_plain_and_complete():
    doc = json.loads(status_json(_reply(), "h:1"))
    assert doc["address"] == "h:1" and doc["num_expired"] == 3 and doc["uptime_s"] == 30.0
    (rank,) = doc["ranks"]
    assert rank["age_s"] == 1.25
    assert [(p["role"], p["attention"], p["dtype"]) for p in rank["pools"]] == [
        ("target", "mla", "float8_e4m3fn"), ("draft", "mha", "bfloat16")]


def test_table_has_one_line_per_rank_and_says_what_was_left_out():
    text = status_table(_reply(num_omitted=5), "h:1")
    lines = text.splitlines()
    assert lines[0].startswith("bootstrap h:1: up 30.0 s, 6 ranks on 1+ nodes")
    assert lines[2].split()[:4] == ["prefill-0", "0/1", "0/1", "1.2"]
    assert "target mla float8_e4m3fn page 64" in lines[2] and "latent x 576" in lines[2]
    assert "draft mha bfloat16 page 16" in lines[2] and "2/8 heads" in lines[2]
    assert lines[-1] == f"... and 5 more ranks (a reply lists at most {MAX_STATUS_RANKS})"


def test_reply_is_bounded():
    r = _reply()
    with pytest.raises(ValueError, match="more than"):
        StatusReply(**{**r.__dict__, "ranks": r.ranks * (MAX_STATUS_RANKS + 1)})


def _fused_pool() -> bm.PoolDescriptor:
    return bm.PoolDescriptor(role=bm.PoolRole.TARGET, attention=bm.AttentionKind.MHA, dtype="bfloat16", itemsize=2,
                             page_size=16, num_pages=4, num_layers=1, num_kv_heads=2, total_kv_heads=2, head_dim=8,
                             page_layout=bm.PageLayout.HND, kv_layout=bm.KVLayout.FUSED_CELLS,
                             buffers=(bm.BufferRef(layer=0, component=bm.Component.KV, addr=1 << 30, nbytes=4096),))


@pytest.mark.parametrize("view, descriptor, own", [(PoolSummary, bm.PoolDescriptor, set()),
                                                   (RankStatus, bm.RankInfo, {"age_s"}),
                                                   (StateSummary, bm.StatePoolDescriptor,
                                                    {"num_buffers", "item_bytes"})])
def test_a_view_holds_every_field_of_its_descriptor_but_the_withheld(view, descriptor, own):
    view_fields = {f.name: f for f in dataclasses.fields(view)}
    source_fields = {f.name: f for f in dataclasses.fields(descriptor)}
    assert set(view_fields) == set(source_fields) - WITHHELD[descriptor] | own
    view_types, source_types = typing.get_type_hints(view), typing.get_type_hints(descriptor)
    for name in set(view_fields) & set(source_fields) - {"pools", "states"}:  # summarised
        assert view_types[name] == source_types[name], name
        assert view_fields[name].default == source_fields[name].default, name


def test_of_copies_every_field_by_name():
    rank = make_rank(pools=(make_pool(), make_pool(role=bm.PoolRole.DRAFT, base=0x6000_0000_0000)))
    status = RankStatus.of(rank, age_s=2.0)
    for name in {f.name for f in dataclasses.fields(RankStatus)} - {"age_s", "pools", "states"}:
        assert getattr(status, name) == getattr(rank, name), name
    for summary, pool in zip(status.pools, rank.pools, strict=True):
        for f in dataclasses.fields(PoolSummary):
            assert getattr(summary, f.name) == getattr(pool, f.name), f.name


def test_the_encoded_reply_keeps_the_fields_of_protocol_version_5():
    """A rank and pool with default values encode the fields the status had
    before the view was derived: a descriptor field added with
    ``omit_default`` adds nothing; one added otherwise fails here, and needs
    a protocol version bump (bootstrap/codec.py) along with this list."""
    body = msgpack.unpackb(codec.encode(_reply()))["body"]
    (rank,) = body["ranks"]
    assert set(rank) == {"node_id", "dp_rank", "dp_size", "tp_rank", "tp_size", "session", "control_endpoint",
                         "age_s", "pools"}
    assert {frozenset(p) for p in rank["pools"]} == {frozenset({
        "role", "attention", "dtype", "page_size", "num_pages", "num_layers", "num_kv_heads", "total_kv_heads",
        "head_dim", "page_layout"})}
    assert codec.decode(codec.encode(_reply())) == _reply()


def test_fields_off_their_defaults_reach_the_status():
    rank = dataclasses.replace(make_rank(pools=(_fused_pool(),)), transport="nixl")
    reply = dataclasses.replace(_reply(), ranks=(RankStatus.of(rank, age_s=0.5),))
    (encoded,) = msgpack.unpackb(codec.encode(reply))["body"]["ranks"]
    assert encoded["transport"] == "nixl" and encoded["pools"][0]["kv_layout"] == "fused_cells"
    assert codec.decode(codec.encode(reply)) == reply
    doc = json.loads(status_json(reply, "h:1"))
    assert doc["ranks"][0]["transport"] == "nixl" and doc["ranks"][0]["fenced"] is False
    assert "2/2 heads x 8 hnd fused_cells" in status_table(reply, "h:1").splitlines()[2]


def test_a_ranks_state_pools_show_without_their_addresses():
    buf = bm.StateBuffer(addr=0x7000_0000_0000, item_bytes=480, num_items=9, slice_dim=96)
    state = bm.StatePoolDescriptor(kind="mamba", sharding=bm.StateSharding.SHARDED, exact=True, buffers=(buf, buf))
    rank = dataclasses.replace(make_rank(pools=(make_pool(),)), states=(state,))
    (summary,) = RankStatus.of(rank, age_s=1.0).states
    assert (summary.kind, summary.sharding, summary.exact, summary.num_buffers, summary.item_bytes) == \
        ("mamba", bm.StateSharding.SHARDED, True, 2, 960)
    reply = StatusReply(**{**_reply().__dict__, "ranks": (RankStatus.of(rank, age_s=1.0),)})
    assert str(0x7000_0000_0000) not in status_json(reply, "x") and "state mamba sharded x 2 buffers" in \
        status_table(reply, "x")
