"""``python -m benchmarks metrics-cost``: what Prometheus metrics cost a rank.

Two measures that survive a shared, oversubscribed machine (CPU time, not
wall time, and on/off runs interleaved rather than compared across runs):

- **per scrape**: while a workload runs with ``KVFERRY_METRICS_PORT`` set,
  a scraper thread here fetches both ranks' ``/metrics`` every
  ``--interval`` seconds. Each rank's threads are read from
  ``/proc/PID/task/*/stat`` at the first and last scrape; prometheus-client
  answers each request on a thread of its own that then exits, so the
  process's CPU minus its live threads' is the CPU of the scrapes
  (``rank_cpu_ms_per_scrape``: an upper bound, as any other thread that
  exits in the window counts too), and the growth of the live threads shows
  whether the data-path threads paid anything besides.
- **throughput**: each round runs the workload three ways, in an order
  that rotates: metrics off; off, with the same scraper fetching a static
  page of the same size from a stand-in process (the scraper's own CPU and
  wake-ups on a machine the ranks share, not the ranks'); and on, scraped.
  Each round's GB/s and CPU seconds per GB are kept; ``paired_gbps_ratio``
  is the median over rounds of on / off of the same round, and
  ``control_gbps_ratio`` the same of the stand-in run (the spread of single
  runs on a shared 2-core VM is 20-40%).

The ranks serve the port base + rank (prefill) and base + 100 + rank
(decode), as :mod:`harness.workload` assigns them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

from benchmarks.hosts import LocalHost, Link
from benchmarks.runs import run_kvferry
from benchmarks.workloads import FULL
from harness.ports import free_ports

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_s(stat_path: str) -> float:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime + stime


def pid_listening_on(port: int) -> int | None:
    """The process of this user listening on TCP ``port`` (IPv4), or None."""
    inodes = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return int(pid)
        except OSError:
            continue
    return None


def cpu_sample(pid: int) -> tuple[float, dict[int, float]]:
    """The process's CPU seconds, and each live thread's."""
    tasks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            tasks[int(tid)] = _cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            pass  # exited meanwhile
    return _cpu_s(f"/proc/{pid}/stat"), tasks


class Scraper:
    """Scrapes ``ports`` every ``interval_s`` on a thread; notes each rank's
    CPU at its first and latest scrape."""

    def __init__(self, ports: dict[str, int], interval_s: float) -> None:
        self.ports, self.interval_s = ports, interval_s
        self.first: dict[str, tuple[float, dict[int, float]]] = {}
        self.last: dict[str, tuple[float, dict[int, float]]] = {}
        self.num_scrapes = {role: 0 for role in ports}
        self.client_cpu_s = 0.0
        self._pids: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        # Every 0.2 s until each rank serves (the first sample), then every interval.
        while not self._stop.wait(0.2 if len(self.first) < len(self.ports) else self.interval_s):
            for role, port in self.ports.items():
                c0 = time.thread_time()
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                        r.read()
                    pid = self._pids.get(role) or pid_listening_on(port)
                    sample = cpu_sample(pid) if pid else None
                except OSError:
                    continue  # not serving yet, or gone
                finally:
                    self.client_cpu_s += time.thread_time() - c0
                self._pids[role] = pid
                self.last[role] = sample
                if role not in self.first:
                    self.first[role] = sample
                else:
                    self.num_scrapes[role] += 1  # scrapes after the first sample

    def per_rank(self) -> dict[str, dict]:
        out = {}
        for role, (p0, t0) in self.first.items():
            p1, t1 = self.last[role]
            n = self.num_scrapes[role]
            live = {tid: t1[tid] - t0.get(tid, 0.0) for tid in t1}
            exited = (p1 - p0) - sum(live.values())
            out[role] = dict(scrapes=n, process_cpu_s=round(p1 - p0, 3),
                             rank_cpu_ms_per_scrape=round(exited / n * 1e3, 3) if n else None,
                             busiest_threads_cpu_s=sorted((round(v, 3) for v in live.values()), reverse=True)[:4])
        return out


_STAND_IN = """
import http.server, sys
body = b"# kvferry stand-in\\n" + b"x" * int(sys.argv[1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


def _stand_in_run(w, link: Link, interval_s: float) -> dict:
    """Metrics off; the scraper fetches a static page of a rank's size from
    another process instead."""
    proc = subprocess.Popen([sys.executable, "-c", _STAND_IN, "8600"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        with Scraper({"stand-in": port}, interval_s / 2):  # as many fetches as two ranks get
            row = run_kvferry(w, LocalHost(), link)
    finally:
        proc.kill()
        proc.wait(10)
    return dict(metrics="off, stand-in scraped", gbps=row["gbps"], cpu_s_per_gb=row["cpu_s_per_gb"],
                p50_ms=row["p50_ms"])


def run_round(w, link: Link, interval_s: float | None, condition: str = "on") -> dict:
    """One kvferry run of ``w`` under ``condition``: ``off``, ``control``
    (off, the scraper busy with a stand-in) or ``on`` (scraped every
    ``interval_s``)."""
    os.environ.pop("KVFERRY_METRICS_PORT", None)
    if condition == "control":
        return _stand_in_run(w, link, interval_s)
    if condition == "off":
        row = run_kvferry(w, LocalHost(), link)
        return dict(metrics="off", gbps=row["gbps"], cpu_s_per_gb=row["cpu_s_per_gb"], p50_ms=row["p50_ms"])
    base = free_ports(101)  # rank 0 of prefill at base, of decode at base + 100
    os.environ["KVFERRY_METRICS_PORT"] = str(base)
    try:
        with Scraper({"prefill": base, "decode": base + 100}, interval_s) as scraper:
            row = run_kvferry(w, LocalHost(), link)
    finally:
        os.environ.pop("KVFERRY_METRICS_PORT", None)
    return dict(metrics=f"scraped every {interval_s:g} s", gbps=row["gbps"], cpu_s_per_gb=row["cpu_s_per_gb"],
                p50_ms=row["p50_ms"], ranks=scraper.per_rank(),
                client_cpu_ms_per_scrape=round(scraper.client_cpu_s / max(1, sum(scraper.num_scrapes.values()))
                                               * 1e3, 3))


_CONDITIONS = ("off", "control", "on")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks metrics-cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="mha-8k-contig", help="comma-separated workload names (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the three conditions per workload (default %(default)s)")
    ap.add_argument("--interval", type=float, default=1.0,
                    help="seconds between scrapes of each rank (default %(default)s; Prometheus' default is 15)")
    ap.add_argument("--requests", type=int, help="override the workloads' request counts")
    ap.add_argument("--json", metavar="PATH", help="write every round as JSON")
    args = ap.parse_args(argv)
    names = args.only.split(",")
    workloads = [w for w in FULL if w.name in names]
    if len(workloads) != len(names):
        ap.error(f"unknown workload in {args.only!r}")
    if args.requests:
        from dataclasses import replace
        workloads = [replace(w, requests=args.requests) for w in workloads]
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the rank processes are ended
    link = Link(protocol="tcp", hostname="127.0.0.1", peer_hostname="127.0.0.1", device="", peer_device="")
    report = {}
    for w in workloads:
        rounds = []
        for i in range(args.rounds):
            # Rotate the order, so that a trend in the machine's load favours none.
            order = _CONDITIONS[i % 3:] + _CONDITIONS[:i % 3]
            pair = {c: run_round(w, link, args.interval, c) for c in order}
            rounds.append(pair)
            print(w.name, i, json.dumps(pair), flush=True)
        ratios = [p["on"]["gbps"] / p["off"]["gbps"] for p in rounds if p["off"]["gbps"]]
        control = [p["control"]["gbps"] / p["off"]["gbps"] for p in rounds if p["off"]["gbps"]]
        per_scrape = [r["rank_cpu_ms_per_scrape"] for p in rounds for r in p["on"]["ranks"].values()
                      if r["rank_cpu_ms_per_scrape"] is not None]
        summary = dict(paired_gbps_ratio=round(statistics.median(ratios), 3), gbps_ratios=[round(x, 3) for x in ratios],
                       control_gbps_ratio=round(statistics.median(control), 3),
                       control_gbps_ratios=[round(x, 3) for x in control],
                       cpu_s_per_gb_control=[p["control"]["cpu_s_per_gb"] for p in rounds],
                       cpu_s_per_gb_off=[p["off"]["cpu_s_per_gb"] for p in rounds],
                       cpu_s_per_gb_on=[p["on"]["cpu_s_per_gb"] for p in rounds],
                       rank_cpu_ms_per_scrape_median=round(statistics.median(per_scrape), 3) if per_scrape else None)
        print(w.name, "summary", json.dumps(summary), flush=True)
        report[w.name] = dict(summary=summary, rounds=rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(interval_s=args.interval, workloads=report), f, indent=1)
    return 0
