"""Issue 18's targets, computed from one run's rows (pure: no processes).

Over TCP (kvferry's rows on Mooncake's TCP transport or on NIXL with
``UCX_TLS=tcp``; raw engines the same; same run, same requests):

- throughput: for 8k-token contiguous and scattered requests and 64
  concurrent 128-token requests, kvferry on its fastest transport reaches
  >= 80% of the plain TCP stream (``limit``, ``tcp-stream``) and beats raw
  Mooncake merged;
- latency: for 128-token requests at concurrency 1, kvferry's p50 is within
  0.5 ms of the fastest raw engine's (raw Mooncake or raw NIXL, merged).

Only the workloads in the run are evaluated; a row missing from a workload
gives ``None`` in the figures that need it and ``met=None``.
"""

from __future__ import annotations

THROUGHPUT_WORKLOADS = ("mha-8k-contig", "mha-8k-scatter", "mha-128-c64")
LATENCY_WORKLOAD = "mha-128"
STREAM_SHARE = 0.8
P50_SLACK_MS = 0.5
KVFERRY_MODES = ("kvferry", "kvferry-nixl")
WORKLOADS = (*THROUGHPUT_WORKLOADS, LATENCY_WORKLOAD)


def over_tcp(row: dict) -> bool:
    """Whether a row's bytes went through TCP sockets (not memory shortcuts)."""
    transport = row.get("transport", "")
    if transport.startswith("nixl"):
        return row.get("ucx_tls") == "tcp"
    return transport in ("mooncake-tcp", "tcp-socket")


def _pick(rows: list[dict], workload: str, modes, baseline: str | None = None) -> list[dict]:
    return [r for r in rows if r["workload"] == workload and r["mode"] in modes and over_tcp(r)
            and (baseline is None or r.get("baseline") == baseline)]


def _name(row: dict) -> str:
    tls = f" UCX_TLS={row['ucx_tls']}" if "ucx_tls" in row else ""
    return f"{row['mode']} ({row['transport']}{tls})"


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def evaluate(rows: list[dict]) -> list[dict]:
    """One entry per target: the figures, the ratio and whether it is met."""
    out = []
    present = {r["workload"] for r in rows}
    for w in (w for w in THROUGHPUT_WORKLOADS if w in present):
        kv = max(_pick(rows, w, KVFERRY_MODES), key=lambda r: r["gbps"], default=None)
        stream = next(iter(_pick(rows, w, ("limit",), "tcp-stream")), None)
        merged = next(iter(_pick(rows, w, ("mooncake",), "merged")), None)
        share = _ratio(kv and kv["gbps"], stream and stream["gbps"])
        over_mc = _ratio(kv and kv["gbps"], merged and merged["gbps"])
        met = None if share is None or over_mc is None else share >= STREAM_SHARE and over_mc > 1
        out.append({"target": f"{w}: kvferry >= {STREAM_SHARE:.0%} of the TCP stream and > raw Mooncake merged",
                    "workload": w, "kvferry": kv and _name(kv), "kvferry_gbps": kv and kv["gbps"],
                    "tcp_stream_gbps": stream and stream["gbps"], "mooncake_merged_gbps": merged and merged["gbps"],
                    "share_of_stream": share, "ratio_to_mooncake_merged": over_mc, "met": met})
    if LATENCY_WORKLOAD not in present:
        return out
    kv = min(_pick(rows, LATENCY_WORKLOAD, KVFERRY_MODES), key=lambda r: r["p50_ms"], default=None)
    raw = min(_pick(rows, LATENCY_WORKLOAD, ("mooncake", "nixl"), "merged"), key=lambda r: r["p50_ms"], default=None)
    gap = round(kv["p50_ms"] - raw["p50_ms"], 3) if kv and raw else None
    out.append({"target": f"{LATENCY_WORKLOAD}: kvferry p50 within {P50_SLACK_MS} ms of the fastest raw engine",
                "workload": LATENCY_WORKLOAD, "kvferry": kv and _name(kv), "kvferry_p50_ms": kv and kv["p50_ms"],
                "raw": raw and _name(raw), "raw_p50_ms": raw and raw["p50_ms"], "p50_gap_ms": gap,
                "met": None if gap is None else gap <= P50_SLACK_MS})
    return out


def print_targets(targets: list[dict]) -> None:
    print("Issue 18 targets (over TCP, same run, same requests):")
    for t in targets:
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        if "share_of_stream" in t:
            share, over = t["share_of_stream"], t["ratio_to_mooncake_merged"]
            figures = (f"{t['kvferry'] or '-'} {t['kvferry_gbps'] or '-'} GB/s; "
                       f"{'-' if share is None else f'{share:.0%}'} of TCP stream {t['tcp_stream_gbps'] or '-'}; "
                       f"{'-' if over is None else f'{over:.0%}'} of raw Mooncake merged "
                       f"{t['mooncake_merged_gbps'] or '-'}")
        else:
            gap = "-" if t["p50_gap_ms"] is None else t["p50_gap_ms"]
            figures = (f"{t['kvferry'] or '-'} p50 {t['kvferry_p50_ms'] or '-'} ms; fastest raw {t['raw'] or '-'} "
                       f"p50 {t['raw_p50_ms'] or '-'} ms; gap {gap} ms")
        print(f"  [{verdict:>7}] {t['target']}: {figures}")
