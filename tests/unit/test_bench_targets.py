"""Issue 18's targets from a run's rows (benchmarks.targets, pure)."""

from benchmarks.targets import evaluate, over_tcp


def _row(workload, mode, transport, gbps, p50=1.0, **extra):
    return {"workload": workload, "mode": mode, "transport": transport, "gbps": gbps, "p50_ms": p50, **extra}


def test_over_tcp_keeps_same_host_shortcuts_out():
    assert over_tcp(_row("w", "nixl", "nixl-ucx", 1, ucx_tls="tcp"))
    assert not over_tcp(_row("w", "nixl", "nixl-ucx", 1, ucx_tls="default"))
    assert over_tcp(_row("w", "kvferry", "mooncake-tcp", 1)) and not over_tcp(_row("w", "limit", "memcpy", 1))


def test_fastest_kvferry_transport_over_tcp_is_judged_against_stream_and_mooncake():
    rows = [_row("mha-8k-contig", "kvferry", "mooncake-tcp", 2.0),
            _row("mha-8k-contig", "kvferry-nixl", "nixl-ucx", 9.0, ucx_tls="default"),  # shared memory: left out
            _row("mha-8k-contig", "kvferry-nixl", "nixl-ucx", 3.3, ucx_tls="tcp"),
            _row("mha-8k-contig", "mooncake", "mooncake-tcp", 2.5, baseline="merged"),
            _row("mha-8k-contig", "limit", "tcp-socket", 4.0, baseline="tcp-stream"),
            _row("mha-128-c64", "kvferry", "mooncake-tcp", 3.3),
            _row("mha-128-c64", "mooncake", "mooncake-tcp", 3.4, baseline="merged"),
            _row("mha-128-c64", "limit", "tcp-socket", 4.0, baseline="tcp-stream")]
    by_workload = {t["workload"]: t for t in evaluate(rows)}
    assert set(by_workload) == {"mha-8k-contig", "mha-128-c64"}  # only what ran
    contig = by_workload["mha-8k-contig"]
    assert contig["kvferry_gbps"] == 3.3 and contig["kvferry"] == "kvferry-nixl (nixl-ucx UCX_TLS=tcp)"
    assert contig["share_of_stream"] == 0.825 and contig["ratio_to_mooncake_merged"] == 1.32 and contig["met"]
    c64 = by_workload["mha-128-c64"]
    assert c64["share_of_stream"] == 0.825 and c64["met"] is False  # 80% of the stream, but not above Mooncake


def test_short_request_p50_against_the_fastest_raw_engine_over_tcp():
    rows = [_row("mha-128", "kvferry", "mooncake-tcp", 1, p50=8.0),
            _row("mha-128", "mooncake", "mooncake-tcp", 1, p50=7.8, baseline="merged"),
            _row("mha-128", "nixl", "nixl-ucx", 1, p50=7.2, baseline="merged", ucx_tls="tcp"),
            _row("mha-128", "nixl", "nixl-ucx", 1, p50=2.0, baseline="merged", ucx_tls="default")]
    [t] = evaluate(rows)
    assert t["raw_p50_ms"] == 7.2 and t["p50_gap_ms"] == 0.8 and t["met"] is False
    [t] = evaluate(rows[:2])
    assert t["p50_gap_ms"] == 0.2 and t["met"] is True
