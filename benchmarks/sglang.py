"""``python -m benchmarks.sglang``: kvferry and SGLang's own Mooncake backend, side by side.

The same harness (``tests/engines/sglang``: SGLang's pools, ``KVArgs``,
``MetadataBuffers`` and call sequence, one prefill and one decode process)
runs the same requests through ``--disaggregation-transfer-backend kvferry``
and ``mooncake``; raw Mooncake (:mod:`benchmarks.raw`, the bare engine at its
best pattern) moves the same bytes per request. Per workload: GB/s over the
transfer phase, p50/p99 request latency (first send to the sender's
Success), descriptors per request, CPU seconds per GB (prefill + decode
processes, the harness loop included, the same for both backends).

Run it in SGLang's environment (``make bench-sglang``); ``--out`` rewrites the
results block of a Markdown file.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

from tests.engines.sglang.procs import ROOT, Run, child_env

GEOMETRY = dict(layers=8, heads=8, head_dim=128, page_size=16, pool_pages=600)
WORKLOADS = [("short, scattered pages", "bench-scatter-2-40"), ("long, scattered pages", "bench-scatter-32-12"),
             ("long, contiguous pages", "bench-contig-32-12")]
BEGIN, END = "<!-- bench-sglang:begin -->", "<!-- bench-sglang:end -->"


def page_bytes() -> int:
    g = GEOMETRY
    return 2 * g["layers"] * g["page_size"] * g["heads"] * g["head_dim"] * 2  # K and V, bf16


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def run_backend(backend: str, scenario: str) -> dict:
    _, kind, pages, count = scenario.split("-")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in GEOMETRY.items()] + ["--poll-interval-s=0.0005"]
    env = {"KVFERRY_STAGING_BYTES": str(64 << 20), "KVFERRY_STAGE_PART_BYTES": str(16 << 20),
           "MOONCAKE_PROTOCOL": "tcp"}
    with Run(scenario, backend=backend, env=env, extra_args=args, timeout_s=300) as run:
        run.finish()
        pre, dec = run.prefill[0], run.decode[0]
        results = [r for r in pre.events("RESULT") if r["state"] == "Success"]
        if len(results) != int(count):
            raise RuntimeError(f"{backend} {scenario}: {len(results)} of {count} requests succeeded")
        done_p, done_d = pre.events("DONE")[0], dec.events("DONE")[0]
    total = int(count) * int(pages) * page_bytes()
    lat = [r["e2e_s"] * 1e3 for r in results]
    descriptors = sum(r.get("descriptors", 0) for r in results) or done_p.get("engine_descriptors", 0)
    return {"gbps": total / done_p["wall_s"] / 1e9, "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99),
            "descriptors": descriptors / int(count), "cpu_s_per_gb": (done_p["cpu_s"] + done_d["cpu_s"]) / (total / 1e9)}


def run_raw(scenario: str) -> dict:
    _, _, pages, count = scenario.split("-")
    request_bytes, n = int(pages) * page_bytes(), int(count)
    base = [sys.executable, "-m", "benchmarks.raw"]
    recv = subprocess.Popen(base + ["mc-recv", "--bytes", str(request_bytes * n), "--lifetime-s", "300"], cwd=ROOT,
                            env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = recv.stdout.readline()
        while line and not line.startswith("RAW_READY"):
            line = recv.stdout.readline()
        _, session, addr = line.split()
        t0 = time.process_time()
        out = subprocess.run(base + ["mc-send", "--session", session, "--addr", addr, "--request-bytes",
                                     str(request_bytes), "--requests", str(n + 1), "--warmup", "1",
                                     "--concurrency", str(n)], cwd=ROOT, env=child_env(), capture_output=True,
                             text=True, timeout=300)
        del t0
        result = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RAW_RESULT")).split(" ", 1)[1])
    finally:
        recv.kill()
        recv.wait(timeout=10)
    gb = result["bytes"] / 1e9
    return {"gbps": gb / result["elapsed_s"], "p50_ms": _pct(result["latencies_ms"], 0.5),
            "p99_ms": _pct(result["latencies_ms"], 0.99), "descriptors": result["descriptors_per_request"],
            "cpu_s_per_gb": result["cpu_s"] / gb}


def table(rows: list[tuple[str, str, dict]]) -> str:
    out = ["| workload | path | GB/s | p50 ms | p99 ms | descriptors / request | CPU s / GB |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for workload, path, m in rows:
        out.append(f"| {workload} | {path} | {m['gbps']:.2f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | "
                   f"{m['descriptors']:.0f} | {m['cpu_s_per_gb']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sglang")
    ap.add_argument("--out", help="a Markdown file whose results block is rewritten")
    ap.add_argument("--quick", action="store_true", help="the short-request workload only")
    a = ap.parse_args(argv)
    rows = []
    for name, scenario in WORKLOADS[:1] if a.quick else WORKLOADS:
        for path, fn in (("kvferry", lambda: run_backend("kvferry", scenario)),
                         ("SGLang mooncake backend", lambda: run_backend("mooncake", scenario)),
                         ("raw Mooncake (bare engine)", lambda: run_raw(scenario))):
            metrics = fn()
            rows.append((name, path, metrics))
            print(name, path, json.dumps(metrics), flush=True)
    g = GEOMETRY
    text = (f"{BEGIN}\nMeasured {time.strftime('%Y-%m-%d')}, TCP on loopback, one prefill and one decode process on a "
            f"shared 2-core host; pool: {g['layers']} layers, {g['heads']} KV heads x {g['head_dim']}, bf16, "
            f"page size {g['page_size']} ({page_bytes() // 1024} KiB per page over all buffers); requests "
            f"in flight together, workloads `{'`, `'.join(s for _, s in WORKLOADS)}` "
            f"(`bench-<pages>-<count>`).\n\n{table(rows)}\n{END}")
    print(text)
    if a.out:
        with open(a.out) as f:
            doc = f.read()
        doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: text, doc, flags=re.S) \
            if BEGIN in doc else doc + "\n" + text + "\n"
        with open(a.out, "w") as f:
            f.write(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
