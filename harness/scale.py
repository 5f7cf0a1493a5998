"""The scale test: thousands of rooms, many ranks, real processes, the real
Mooncake engine over TCP loopback, every byte checked.

``python -m harness.scale [--quick] [--json PATH]`` runs two phases, each
with its own bootstrap server and rank processes (:mod:`harness.scale_rank`):

- ``one-to-one``: 4,096 rooms put in flight at once between one prefill and
  one decode rank, small pages (1-8 pages of 128 bytes per buffer), four
  waves of them, each once the last ended;
- ``many``: 16 prefill ranks (4 processes of 4 managers) feeding 4 decode
  ranks (2 processes of 2), rooms arriving at random over 40 s, 5% of them
  aborted by one side or the other at a random moment.

It reports (JSON) per role: CPU per room (the whole process's, and its
Python threads' alone: what needs the interpreter lock), control messages
received per room, CPU per GB, RSS, threads and file descriptors, also per quarter of the run (from the first room that ended to
the end of the arrivals), and exits 1 when a room that nobody aborted did not
succeed, a byte differs, or threads, descriptors, memory or CPU per room
grew from the second quarter to the last (the first opens connections).
``--quick`` runs a small version of both (about 30 s), for ``make test-scale``.
"""

from __future__ import annotations

import argparse
import json
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace

from harness.launch import BootstrapProcess, child_env
from harness.scale_rank import ScaleSpec

#: phase -> (spec, managers per prefill process, managers per decode process)
PHASES = {
    # 4 waves of 4,096 rooms, each wave all in flight at once; pages of 128 bytes per buffer.
    "one-to-one": (ScaleSpec(num_rooms=4 * 4096, waves=4, timeout_s=120.0), 1, 1),
    # Pages of 16 tokens of 64-wide heads: 2 KiB per buffer, 8 KiB a page over K and V of 2 layers.
    "many": (ScaleSpec(num_prefill=16, num_decode=4, num_rooms=8000, arrival_s=40.0, abort_fraction=0.05,
                       page_size=16, head_dim=64, max_pages=16, prefill_pages=2048, decode_pages=8000,
                       timeout_s=10.0), 4, 2),
}
QUICK = {
    "one-to-one": (replace(PHASES["one-to-one"][0], num_rooms=4 * 256), 1, 1),
    "many": (replace(PHASES["many"][0], num_prefill=4, num_decode=2, num_rooms=400, arrival_s=6.0), 2, 2),
}


def _start(spec: ScaleSpec, role: str, indices: list[int], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness.scale_rank", "--role", role,
                             "--index", ",".join(map(str, indices)), "--spec", json.dumps(asdict(spec))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=child_env())


def _await_ready(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        with selectors.DefaultSelector() as sel:
            sel.register(p.stdout, selectors.EVENT_READ)
            line = p.stdout.readline() if sel.select(max(0.1, deadline - time.monotonic())) else ""
        if line.strip() != "READY":
            raise RuntimeError(f"a scale rank process did not start within {timeout_s:g} s: {line!r}")


def run_phase(spec: ScaleSpec, per_prefill: int, per_decode: int, timeout_s: float) -> dict:
    """Start the server and the processes, run, collect every RESULT."""
    log = tempfile.TemporaryFile(mode="w+")
    procs: list[subprocess.Popen] = []
    with BootstrapProcess() as server:
        spec = replace(spec, bootstrap=server.address)
        try:
            groups = [("prefill", list(range(i, min(i + per_prefill, spec.num_prefill))))
                      for i in range(0, spec.num_prefill, per_prefill)]
            groups += [("decode", list(range(i, min(i + per_decode, spec.num_decode))))
                       for i in range(0, spec.num_decode, per_decode)]
            for role in ("prefill", "decode"):  # prefill ranks registered before any lookup
                started = [_start(spec, r, idx, log) for r, idx in groups if r == role]
                procs += started
                _await_ready(started, 120.0)
            start = time.time() + 0.5
            for p in procs:
                p.stdin.write(f"START {start}\n")
                p.stdin.flush()
            deadline = time.monotonic() + timeout_s
            results = []
            for p in procs:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                results += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
            wall_s = time.time() - start
        except BaseException:
            for p in procs:
                p.kill()
            log.seek(0)
            sys.stderr.write(log.read()[-5000:])
            raise
    log.close()
    return summarise(spec, results, wall_s, len(procs))


def _quarters(samples: list[dict], end_s: float) -> list[list[dict]]:
    """The samples of each quarter of [first completion, end_s]: what comes
    before the first room ended is start-up, not growth."""
    t0 = next((s["t_s"] for s in samples if s["rooms_done"]), 0.0)
    span = max(end_s - t0, 0.0)
    return [[s for s in samples if t0 + q * span / 4 <= s["t_s"] <= t0 + (q + 1) * span / 4] or samples[-1:]
            for q in range(4)]


def _window(samples: list[dict]) -> dict:
    """RSS, threads, descriptors and CPU per room over consecutive samples."""
    rooms = samples[-1]["rooms_done"] - samples[0]["rooms_done"]
    cpu = samples[-1]["cpu_s"] - samples[0]["cpu_s"]
    py = samples[-1]["python_cpu_s"] - samples[0]["python_cpu_s"]
    return dict(rss_mb=round(max(s["rss_bytes"] for s in samples) / 2**20, 1),
                threads=max(s["threads"] for s in samples), fds=max(s["fds"] for s in samples),
                cpu_ms_per_room=round(cpu / rooms * 1e3, 3) if rooms else None,
                python_cpu_ms_per_room=round(py / rooms * 1e3, 3) if rooms else None, rooms=rooms)


def summarise(spec: ScaleSpec, results: list[dict], wall_s: float, num_procs: int) -> dict:
    report = dict(spec=asdict(spec), processes=num_procs, wall_s=round(wall_s, 2), roles={}, problems=[])
    end_s = spec.arrival_s or wall_s  # flatness: over the arrival window (the whole run when all come at once)
    for role in ("prefill", "decode"):
        mine = [r for r in results if r["role"] == role]
        outs = [o for r in mine for o in r["outcomes"]]
        cpu = sum(r["samples"][-1]["cpu_s"] - r["samples"][0]["cpu_s"] for r in mine)
        py = sum(r["samples"][-1]["python_cpu_s"] - r["samples"][0]["python_cpu_s"] for r in mine)
        msgs = sum(r["samples"][-1]["msgs"] - r["samples"][0]["msgs"] for r in mine)
        rooms = sum(o["rooms"] for o in outs)
        gb = sum(o["bytes"] for o in outs) / 1e9
        per_proc = []
        for r in mine:
            quarters = [_window(q) for q in _quarters(r["samples"], end_s)]
            per_proc.append(dict(pid=r["pid"], managers=len(r["indices"]), quarters=quarters,
                                 whole=_window(r["samples"])))
        report["roles"][role] = dict(
            managers=len(outs), rooms=rooms, success=sum(o["success"] for o in outs),
            aborted_failed=sum(o["aborted_failed"] for o in outs),
            aborted_success=sum(o["aborted_success"] for o in outs),
            max_live_per_manager=max((o["max_live"] for o in outs), default=0),
            gb=round(gb, 4), cpu_s=round(cpu, 2), cpu_ms_per_room=round(cpu / rooms * 1e3, 3) if rooms else None,
            python_cpu_ms_per_room=round(py / rooms * 1e3, 3) if rooms else None,
            msgs_per_room=round(msgs / rooms, 2) if rooms else None,
            cpu_s_per_gb=round(cpu / gb, 1) if gb else None, processes=per_proc)
        problems = report["problems"]
        if rooms != spec.num_rooms:
            problems.append(f"{role}: {rooms} rooms ended, expected {spec.num_rooms}")
        for o in outs:
            problems += [f"{role} {o['index']}: room {r} failed without an abort: {why}" for r, why in o["unexpected"]]
            problems += [f"{role} {o['index']}: {m}" for m in o["mismatches"]]
        for p in per_proc:
            # The second quarter against the last: the first still opens connections
            # and lanes to peers as rooms first reach them (bounded by the peers).
            a, b = p["quarters"][1], p["quarters"][3]
            if b["threads"] > a["threads"] + 2:
                problems.append(f"{role} pid {p['pid']}: threads grew {a['threads']} -> {b['threads']}")
            if b["fds"] > a["fds"] + 8:
                problems.append(f"{role} pid {p['pid']}: file descriptors grew {a['fds']} -> {b['fds']}")
            if b["rss_mb"] > 1.25 * a["rss_mb"] + 32:
                problems.append(f"{role} pid {p['pid']}: RSS grew {a['rss_mb']} -> {b['rss_mb']} MB")
            if spec.arrival_s and a["cpu_ms_per_room"] and b["cpu_ms_per_room"] and \
                    b["cpu_ms_per_room"] > 2.5 * a["cpu_ms_per_room"]:
                problems.append(f"{role} pid {p['pid']}: CPU per room grew {a['cpu_ms_per_room']} -> "
                                f"{b['cpu_ms_per_room']} ms")
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small version (make test-scale)")
    ap.add_argument("--only", choices=sorted(PHASES), help="run one phase")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--timeout-s", type=float, default=480.0, help="per phase")
    args = ap.parse_args(argv)
    phases = QUICK if args.quick else PHASES
    report = {}
    for name, (spec, per_prefill, per_decode) in phases.items():
        if args.only and name != args.only:
            continue
        report[name] = run_phase(spec, per_prefill, per_decode, args.timeout_s)
        print(json.dumps({name: report[name]}, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    problems = [f"{name}: {p}" for name, r in report.items() for p in r["problems"]]
    for p in problems:
        print("PROBLEM " + p, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
