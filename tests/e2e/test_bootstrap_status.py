"""``python -m bootstrap status`` against a real server process with real
registrations: the table for people and the JSON for scripts."""

import json
import os
import subprocess
import sys

import pytest

from bootstrap.client import BootstrapClient
from bootstrap.messages import AttentionKind, BufferRef, Component, PageLayout, PoolDescriptor, PoolRole, RankInfo
from harness.launch import BootstrapProcess

pytestmark = [pytest.mark.e2e, pytest.mark.transport_free]


def _mla_rank(tp_rank: int, node: str = "prefill-a") -> RankInfo:
    target = PoolDescriptor(role=PoolRole.TARGET, attention=AttentionKind.MLA, dtype="float8_e4m3fn", itemsize=1,
                            page_size=64, num_pages=8, num_layers=1, num_kv_heads=1, total_kv_heads=1, head_dim=576,
                            page_layout=PageLayout.NHD,
                            buffers=(BufferRef(layer=0, component=Component.LATENT, addr=4096, nbytes=8 * 64 * 576),))
    draft = PoolDescriptor(role=PoolRole.DRAFT, attention=AttentionKind.MHA, dtype="bfloat16", itemsize=2,
                           page_size=16, num_pages=4, num_layers=1, num_kv_heads=2, total_kv_heads=4, head_dim=8,
                           page_layout=PageLayout.HND,
                           buffers=(BufferRef(layer=0, component=Component.K, addr=1 << 30, nbytes=4096),
                                    BufferRef(layer=0, component=Component.V, addr=2 << 30, nbytes=4096)))
    return RankInfo(node_id=node, dp_rank=0, dp_size=1, tp_rank=tp_rank, tp_size=2,
                    session=f"127.0.0.1:{3000 + tp_rank}", control_endpoint=f"tcp://127.0.0.1:{4000 + tp_rank}",
                    pools=(target, draft), aux=None)


def _status(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bootstrap", "status", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_status_lists_registered_ranks_with_pools_and_age(bootstrap_server):
    with BootstrapClient(bootstrap_server.address, timeout_s=5) as client:
        for tp in (1, 0):
            client.register(_mla_rank(tp))
    out = _status("--addr", bootstrap_server.address, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["address"] == bootstrap_server.address and doc["num_omitted"] == 0
    assert doc["uptime_s"] > 0 and doc["rank_ttl_s"] == 15.0 and doc["node_grace_s"] == 4.0
    assert doc["num_requests"] >= 3
    ranks = doc["ranks"]
    assert [(r["node_id"], r["dp_rank"], r["tp_rank"], r["tp_size"]) for r in ranks] == [
        ("prefill-a", 0, 0, 2), ("prefill-a", 0, 1, 2)]
    assert all(0 <= r["age_s"] < 30 for r in ranks)
    assert ranks[0]["session"] == "127.0.0.1:3000" and ranks[1]["control_endpoint"] == "tcp://127.0.0.1:4001"
    target, draft = ranks[0]["pools"]
    assert (target["role"], target["attention"], target["dtype"], target["page_size"], target["head_dim"]) == (
        "target", "mla", "float8_e4m3fn", 64, 576)
    assert (draft["role"], draft["attention"], draft["dtype"], draft["page_size"], draft["page_layout"]) == (
        "draft", "mha", "bfloat16", 16, "hnd")
    assert draft["num_kv_heads"] == 2 and draft["total_kv_heads"] == 4
    # the view is the descriptors' fields, less addresses (bootstrap.status.WITHHELD)
    assert ranks[0]["transport"] == "mooncake" and target["kv_layout"] == "split"
    assert not {"aux", "staging"} & set(ranks[0]) and not {"buffers", "itemsize"} & set(target)

    table = _status("--addr", bootstrap_server.address)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "2 ranks on 1 nodes" in lines[0]
    assert lines[1].split()[:4] == ["NODE", "DP", "TP", "AGE_S"]
    assert lines[2].split()[:3] == ["prefill-a", "0/1", "0/2"] and lines[3].split()[:3] == ["prefill-a", "0/1", "1/2"]
    assert "target mla float8_e4m3fn page 64" in lines[2] and "draft mha bfloat16 page 16" in lines[2]


def test_status_needs_the_secret_where_auth_is_on(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("s3cret\n")
    with BootstrapProcess(secret="s3cret") as server:
        with BootstrapClient(server.address, timeout_s=5, secret="s3cret") as client:
            client.register(_mla_rank(0, node="authed"))
        refused = _status("--addr", server.address, "--json", env={"KVFERRY_SECRET": ""})
        assert refused.returncode == 1 and "authenticat" in refused.stderr, refused.stderr
        ok = _status("--addr", server.address, "--json", "--secret-file", str(secret_file),
                     env={"KVFERRY_SECRET": ""})
        assert ok.returncode == 0, ok.stderr
        assert [r["node_id"] for r in json.loads(ok.stdout)["ranks"]] == ["authed"]


def test_status_of_a_closed_port_fails_fast_and_says_so():
    out = _status("--addr", "127.0.0.1:1", "--timeout-s", "5")
    assert out.returncode == 1 and "refused the connection" in out.stderr, out.stderr
