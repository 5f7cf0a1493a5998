"""``python -m transfer.bench``: kvferry side by side with raw Mooncake and the
machine's limits, in one run.

Each workload runs three ways:

- ``kvferry``: a bootstrap server, prefill and decode processes, the whole
  path (lookup, handshake, planning, transfer, completion messages);
- ``mooncake``: the same bytes per request between two processes through the
  bare transfer engine at its best pattern (large entries, submit and
  sleep-poll), the best of a few entry sizes;
- ``limit``: on loopback, a plain TCP stream of the same bytes between two
  processes, and a memcpy of them; on RDMA, raw Mooncake is the limit.

Timings leave out one warm-up request (connection set-up). ``--quick`` runs
a short-prompt and a long-prompt subset; ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from importlib import metadata

import numpy as np

from transfer.launch import child_env, run_pd
from transfer.workload import PoolSpec, Spec

PAGE_SIZE = 16
MODELS = {
    # Llama-3-8B-like: 32 layers, 8 KV heads of 128, bf16: 128 KiB per token.
    "llama8b": PoolSpec(role="target", attention="mha", num_layers=32, total_heads=8, head_dim=128),
    # DeepSeek-V3-like MLA: 61 layers of a 576-element latent (512 + 64 rope), bf16.
    "deepseek": PoolSpec(role="target", attention="mla", num_layers=61, total_heads=1, head_dim=576),
}
DRAFT = PoolSpec(role="draft", attention="mha", num_layers=1, total_heads=8, head_dim=128)


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    tokens: int
    concurrency: int
    requests: int
    placement: str = "contiguous"
    prefill_tp: int = 1
    decode_tp: int = 1
    draft: bool = False
    layout: str = "nhd"

    def spec(self) -> Spec:
        target = replace(MODELS[self.model], page_layout=self.layout if self.model == "llama8b" else "nhd")
        pools = (target, replace(DRAFT, page_layout=self.layout)) if self.draft else (target,)
        pages = -(-self.tokens // PAGE_SIZE)
        return Spec(bootstrap="", prefill_pools=pools, decode_pools=pools, prefill_tp=self.prefill_tp,
                    decode_tp=self.decode_tp, page_size=PAGE_SIZE, prefill_pages=max(2 * pages, 64),
                    decode_pages=(self.concurrency + 1) * pages + 8, aux_slots=128,
                    num_rooms=self.requests + 1, warmup_rooms=1, concurrency=self.concurrency,
                    min_tokens=self.tokens, max_tokens=self.tokens, page_placement=self.placement,
                    fill="constant", verify=False, timeout_s=600)

    def request_bytes(self) -> int:
        pools = self.spec().decode_pools
        per_token = sum(p.num_layers * (2 * p.total_heads if p.attention == "mha" else 1) * p.head_dim * 2
                        for p in pools)
        return -(-self.tokens // PAGE_SIZE) * PAGE_SIZE * per_token


QUICK = [
    Workload("mha-128", "llama8b", 128, 1, 60),
    Workload("mha-8k-contig", "llama8b", 8192, 1, 3),
    Workload("mha-8k-scatter", "llama8b", 8192, 1, 3, placement="scattered"),
]
FULL = QUICK + [
    Workload("mha-128-c64", "llama8b", 128, 64, 256, placement="scattered"),
    Workload("mha-2k-c8", "llama8b", 2048, 8, 32, placement="scattered"),
    Workload("mha-32k-contig", "llama8b", 32768, 1, 2),
    Workload("mha-32k-scatter", "llama8b", 32768, 1, 2, placement="scattered"),
    Workload("mla-8k-contig", "deepseek", 8192, 1, 3),
    Workload("mla-8k-scatter", "deepseek", 8192, 1, 3, placement="scattered"),
    Workload("mha-8k-tp2to1-hnd", "llama8b", 8192, 1, 3, prefill_tp=2, layout="hnd"),
    Workload("mha+draft-8k", "llama8b", 8192, 1, 3, draft=True),
]


def _pct(values, q) -> float:
    return round(float(np.percentile(values, q)), 3) if len(values) else 0.0


def _row(w: Workload, mode: str, nbytes: int, seconds: float, latencies, descriptors: float, **extra) -> dict:
    return {"workload": w.name, "mode": mode, "tokens": w.tokens, "concurrency": w.concurrency,
            "bytes": int(nbytes), "gbps": round(nbytes / seconds / 1e9, 3) if seconds else 0.0,
            "p50_ms": _pct(latencies, 50), "p99_ms": _pct(latencies, 99),
            "descriptors_per_request": round(descriptors, 1), **extra}


def run_kvferry(w: Workload) -> dict:
    spec = w.spec()
    runs = run_pd(spec, timeout_s=900, rank_processes=True)
    for run in runs:
        r = run.result
        if r is None or r["failed"] or r["success"] != r["rooms"]:
            raise RuntimeError(f"kvferry run of {w.name} failed on {run.role} {run.tp_rank}:\n{run.log[-2000:]}")
    pre = [r.result for r in runs if r.role == "prefill"]
    dec = [r.result for r in runs if r.role == "decode"]
    nbytes = sum(d["bytes"] for d in dec)
    seconds = max(d["elapsed_s"] for d in dec)
    cpu = sum(r.result["cpu_s"] for r in runs)
    rooms = spec.num_rooms
    return _row(w, "kvferry", nbytes, seconds, [x for d in dec for x in d["latencies_ms"]],
                sum(p["descriptors"] for p in pre) / rooms,
                control_msgs_per_request=round(sum(r.result["control_msgs"] for r in runs) / rooms, 2),
                cpu_s_per_gb=round(cpu / (nbytes / 1e9), 3) if nbytes else None)


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "transfer.bench_raw", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=child_env())


def _line(proc: subprocess.Popen, prefix: str, timeout_s: float = 600) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    proc.kill()
    raise RuntimeError(f"baseline process did not print {prefix!r}")


def run_mooncake(w: Workload, entry_sizes: list[int]) -> dict:
    size = w.request_bytes()
    recv = _spawn("mc-recv", "--bytes", str(size * w.concurrency))
    try:
        session, addr = _line(recv, "RAW_READY ").split()
        best = None
        for entry in entry_sizes:
            send = _spawn("mc-send", "--session", session, "--addr", addr, "--request-bytes", str(size),
                          "--entry-bytes", str(min(entry, size)), "--requests", str(w.requests + 1),
                          "--warmup", "1", "--concurrency", str(w.concurrency))
            res = json.loads(_line(send, "RAW_RESULT "))
            send.wait(30)
            row = _row(w, "mooncake", res["bytes"], res["elapsed_s"], res["latencies_ms"],
                       res["descriptors_per_request"], entry_bytes=min(entry, size),
                       cpu_s_per_gb=round(res["cpu_s"] / (res["bytes"] / 1e9), 3))
            if best is None or row["gbps"] > best["gbps"]:
                best = row
        return best
    finally:
        recv.stdin.close()
        recv.wait(30)


def run_limits(w: Workload) -> list[dict]:
    size = w.request_bytes()
    total = size * w.requests
    recv = _spawn("sock-recv", "--bytes", str(total))
    port = int(_line(recv, "SOCK_READY "))
    chunk = np.full(min(size, 1 << 20), 0x5A, dtype=np.uint8)
    view = memoryview(chunk)
    latencies = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        t0 = time.monotonic()
        for _ in range(w.requests):
            started, left = time.monotonic(), size
            while left:
                n = min(left, len(view))
                sock.sendall(view[:n])
                left -= n
            latencies.append((time.monotonic() - started) * 1e3)
        sock.recv(1)  # the receiver has read every byte
        stream_s = time.monotonic() - t0
    recv.wait(30)
    n = min(size, 1 << 30)
    src, dst = np.full(n, 0x5A, dtype=np.uint8), np.full(n, 1, dtype=np.uint8)
    reps = max(1, min(w.requests, (4 << 30) // n))
    t0 = time.monotonic()
    for _ in range(reps):
        np.copyto(dst, src)
    copy_s = time.monotonic() - t0
    return [_row(w, "limit", total, stream_s, latencies, 0, baseline="tcp-stream"),
            _row(w, "limit", n * reps, copy_s, [copy_s / reps * 1e3], 0, baseline="memcpy")]


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    versions = {}
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "torch"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "platform": platform.platform(),
            "python": platform.python_version(), "packages": versions}


def print_table(rows: list[dict]) -> None:
    head = f"{'workload':<20} {'mode':<9} {'tokens':>6} {'conc':>4} {'GB/s':>6} {'p50 ms':>9} {'p99 ms':>9} " \
           f"{'desc/req':>9} {'msgs/req':>8} {'CPU s/GB':>8}  note"
    print(head)
    print("-" * len(head))
    ref = {r["workload"]: r["gbps"] for r in rows if r["mode"] == "mooncake"}
    for r in rows:
        note = r.get("baseline", "")
        if r["mode"] == "kvferry" and ref.get(r["workload"]):
            note = f"{r['gbps'] / ref[r['workload']]:.0%} of mooncake"
        if r["mode"] == "mooncake":
            note = f"entries of {r['entry_bytes'] >> 10} KiB"
        msgs = r.get("control_msgs_per_request", "")
        cpu = r.get("cpu_s_per_gb", "")
        print(f"{r['workload']:<20} {r['mode']:<9} {r['tokens']:>6} {r['concurrency']:>4} {r['gbps']:>6.2f} "
              f"{r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f} {r['descriptors_per_request']:>9.0f} "
              f"{msgs!s:>8} {cpu!s:>8}  {note}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="kvferry benchmark (see the module docstring)")
    ap.add_argument("--quick", action="store_true", help="a short and a long prompt subset, under 2 minutes")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ap.add_argument("--only", help="comma-separated workload names")
    ap.add_argument("--modes", default="kvferry,mooncake,limit")
    ap.add_argument("--requests", type=int, help="override every workload's request count")
    ap.add_argument("--rounds", type=int, default=None,
                    help="run kvferry and raw Mooncake alternately this many times and keep each one's "
                         "median run (default 3, 1 with --quick): this machine's runs vary by 20-40%%")
    args = ap.parse_args(argv)
    workloads = QUICK if args.quick else FULL
    if args.only:
        wanted = set(args.only.split(","))
        workloads = [w for w in FULL if w.name in wanted]
    if args.requests:
        workloads = [replace(w, requests=args.requests) for w in workloads]
    modes = set(args.modes.split(","))
    entry_sizes = [4 << 20] if args.quick else [1 << 20, 4 << 20, 16 << 20]
    rounds = args.rounds or (1 if args.quick else 3)
    rows: list[dict] = []
    for w in workloads:
        runs: dict[str, list[dict]] = {"kvferry": [], "mooncake": []}
        for _ in range(rounds):
            if "kvferry" in modes:
                runs["kvferry"].append(run_kvferry(w))
            if "mooncake" in modes:
                best = run_mooncake(w, entry_sizes)
                entry_sizes = [best["entry_bytes"]]  # later rounds reuse the best entry size
                runs["mooncake"].append(best)
        entry_sizes = [4 << 20] if args.quick else [1 << 20, 4 << 20, 16 << 20]
        for mode_runs in runs.values():
            if mode_runs:
                median = sorted(mode_runs, key=lambda r: r["gbps"])[len(mode_runs) // 2]
                rows.append(dict(median, rounds=len(mode_runs),
                                 gbps_all=[r["gbps"] for r in mode_runs]))
        if "limit" in modes:
            rows.extend(run_limits(w))
        print_table([r for r in rows if r["workload"] == w.name])
        print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "transport": "tcp", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
