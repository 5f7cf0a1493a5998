"""``python -m benchmarks.busy``: transfers driven by busy schedulers.

Every system runs its prefill and decode sides in separate processes (or,
``kvferry-one``, kvferry's two managers and one loop in one process), each
driven by the scheduler loop of :mod:`benchmarks.busy_loop`: one step every
10 ms, idle (a sleep), busy (10 ms of pure-Python work), or busy with one
more pure-Python thread in each process. Each step polls the live rooms
once. Systems: kvferry, raw Mooncake and raw NIXL driven the same way
(:mod:`benchmarks.busy_ranks`), and SGLang's own Mooncake backend where its
environment exists (``.venv-sglang``, :mod:`benchmarks.busy_sglang`).

Latency: from decode creating a request's receiver to both sides seeing it
done; GB/s over the measured requests (the warm-up ones left out). Figures
are medians of ``--rounds`` runs (this machine's runs vary by 20-40%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np

from benchmarks.busy_loop import BusyConfig
from harness.launch import BootstrapProcess, child_env

WORKLOADS = {
    "short": BusyConfig(pages=32, requests=120, concurrency=1),  # 16 MiB: 512 pieces of 32 KiB
    "8k": BusyConfig(pages=512, requests=12, concurrency=1),  # 8,192 tokens: 256 MiB
    "c64": BusyConfig(pages=32, requests=256, concurrency=64, warmup=64),  # 64 short requests in flight
}
MODES = {"idle": dict(busy_share=0.0, extra_thread=False), "busy": dict(busy_share=1.0, extra_thread=False),
         "busy+thread": dict(busy_share=1.0, extra_thread=True)}
SYSTEMS = ("kvferry", "kvferry-one", "mooncake", "nixl", "sglang")
RANK_TIMEOUT_S = 900


def _spawn(role: str, cfg: BusyConfig, *extra: str, python: str = sys.executable, module: str = "benchmarks.busy_ranks",
           env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([python, "-m", module, role, "--config", cfg.to_json(), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**child_env(), **(env or {})})


def _line(proc: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    tail = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line[len(prefix):]
        tail = (tail + [line])[-40:]
    proc.kill()
    raise RuntimeError(f"no {prefix.strip()} line (exit {proc.poll()}):\n{''.join(tail)}")


def _results(procs: list[tuple[subprocess.Popen, int]]) -> list[dict]:
    """The ``BUSY_RESULT`` lines of each process (how many it prints: one per side it runs)."""
    out = []
    try:
        for proc, num_sides in procs:
            for _ in range(num_sides):
                out.append(json.loads(_line(proc, "BUSY_RESULT ", RANK_TIMEOUT_S)))
    finally:
        for proc, _ in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return out


def run_cell(system: str, cfg: BusyConfig) -> list[dict]:
    """Both sides' results of one system on one workload and mode."""
    if system in ("kvferry", "kvferry-one"):
        with BootstrapProcess() as server:
            cfg = replace(cfg, bootstrap=server.address)
            if system == "kvferry-one":
                return _results([(_spawn("kvferry-both", cfg), 2)])
            return _results([(_spawn("kvferry-prefill", cfg), 1), (_spawn("kvferry-decode", cfg), 1)])
    if system == "sglang":
        from benchmarks.busy_sglang import run_sglang_cell
        return run_sglang_cell(cfg)
    engine = {"mooncake": "mc", "nixl": "nixl"}[system]
    env = {"UCX_NET_DEVICES": "lo"} if engine == "nixl" else {}
    decode = _spawn(f"{engine}-decode", cfg, env=env)
    peer = _line(decode, "BUSY_READY ", 120).strip()
    return _results([(_spawn(f"{engine}-prefill", cfg, "--peer", peer, env=env), 1), (decode, 1)])


def summarize(cfg: BusyConfig, results: list[dict]) -> dict:
    """p50/p99 latency (ms) and GB/s over the measured rooms."""
    by_role = {r["role"]: r for r in results}
    pre, dec = by_role["prefill"], by_role["decode"]
    failed = sorted(set(pre.get("failed", [])) | set(dec.get("failed", [])))
    if failed:  # a failed room's quick end is no latency: the cell is reported as failed
        why = sorted(set(pre.get("errors", [])) | set(dec.get("errors", [])))
        raise RuntimeError(f"{len(failed)} of {cfg.num_rooms} rooms failed: {'; '.join(why)[:1000]}")
    rooms = sorted(int(r) for r in dec["created"])[cfg.warmup:]
    ends = {r: max(pre["done"].get(str(r), np.inf), dec["done"].get(str(r), np.inf)) for r in rooms}
    lat = [(ends[r] - dec["created"][str(r)]) * 1e3 for r in rooms]
    span = max(ends.values()) - min(dec["created"][str(r)] for r in rooms)
    return {"p50_ms": round(float(np.percentile(lat, 50)), 1), "p99_ms": round(float(np.percentile(lat, 99)), 1),
            "gbps": round(cfg.request_bytes * len(rooms) / span / 1e9, 3),
            "cpu_s": round(sum(r.get("cpu_s", 0.0) for r in results), 3),
            "control_msgs_per_request": round(sum(r.get("control_msgs", 0) for r in results) / cfg.num_rooms, 2)}


def _median(rows: list[dict]) -> dict:
    out = dict(rows[0])
    for key in ("p50_ms", "p99_ms", "gbps", "cpu_s", "control_msgs_per_request"):
        out[key] = round(float(np.median([r[key] for r in rows])), 3)
    out["rounds"] = len(rows)
    out["all_p50_ms"] = [r["p50_ms"] for r in rows]
    out["all_p99_ms"] = [r["p99_ms"] for r in rows]
    return out


def sglang_available() -> str:
    """Why SGLang's backend cannot run here ("" when it can)."""
    py = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-sglang", "bin", "python")
    return "" if os.path.exists(py) else "no .venv-sglang (make setup-sglang builds it)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.busy", description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default="kvferry,kvferry-one,mooncake,nixl,sglang")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--requests", type=int, help="override every workload's request count")
    ap.add_argument("--rounds", type=int, default=1, help="runs per cell, interleaved; medians reported")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    systems = args.systems.split(",")
    missing = {}
    if "sglang" in systems and (why := sglang_available()):
        missing["sglang"] = why
        systems.remove("sglang")
    rows: list[dict] = []
    for wname in args.workloads.split(","):
        base = WORKLOADS[wname]
        if args.requests:
            base = replace(base, requests=args.requests)
        for mode in args.modes.split(","):
            cfg = replace(base, **MODES[mode])
            runs: dict[str, list[dict]] = {s: [] for s in systems}
            for _ in range(args.rounds):
                for system in systems:
                    row = {"workload": wname, "mode": mode, "system": system, "request_mib": cfg.request_bytes >> 20}
                    try:
                        row.update(summarize(cfg, run_cell(system, cfg)))
                    except Exception as exc:  # a cell that fails is reported, the run goes on
                        row.update(p50_ms=float("nan"), p99_ms=float("nan"), gbps=0.0, cpu_s=0.0,
                                   control_msgs_per_request=0.0, error=f"{type(exc).__name__}: {exc}"[:2000])
                    runs[system].append(row)
                    print(json.dumps(row), flush=True)
            rows += [_median(r) for r in runs.values() if r]
    print_table(rows)
    for system, why in missing.items():
        print(f"{system}: not run: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "missing": missing, "load_average": list(os.getloadavg())}, f, indent=1)
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"{'workload':8} {'mode':12} {'system':12} {'p50 ms':>8} {'p99 ms':>8} {'GB/s':>7} {'msgs/req':>9}")
    for r in rows:
        print(f"{r['workload']:8} {r['mode']:12} {r['system']:12} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} "
              f"{r['gbps']:7.3f} {r['control_msgs_per_request']:9.2f}" + (f"  {r['error'][:60]}" if "error" in r else ""))


if __name__ == "__main__":
    sys.exit(main())
