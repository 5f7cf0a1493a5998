"""bootstrap.status: the server's status reply as a table and as JSON."""

from __future__ import annotations

import json

import pytest

import bootstrap.messages as bm
from bootstrap.status import MAX_STATUS_RANKS, PoolSummary, RankStatus, StatusReply, status_json, status_table

from ._fixtures import make_pool, make_rank


def _reply(num_omitted: int = 0) -> StatusReply:
    mla = make_pool(attention=bm.AttentionKind.MLA, num_kv_heads=1, total_kv_heads=1, head_dim=576,
                    dtype="float8_e4m3fn", itemsize=1, page_size=64)
    gqa = make_pool(role=bm.PoolRole.DRAFT, num_kv_heads=2, total_kv_heads=8, base=0x6000_0000_0000)
    rank = make_rank(pools=(mla, gqa))
    status = RankStatus(node_id=rank.node_id, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1, session=rank.session,
                        control_endpoint=rank.control_endpoint, age_s=1.25,
                        pools=tuple(PoolSummary.of(p) for p in rank.pools))
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
