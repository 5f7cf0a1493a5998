"""``python -m benchmarks.bootstrap_load``: the bootstrap server under load.

Starts a bootstrap server process on 127.0.0.1, ``--ranks`` simulated
prefill ranks (DeepSeek-like: one MLA pool of ``--layers`` layers, TP groups
of ``--tp-size``) that re-register every ``--register-interval-s``, and
``--clients`` lookup processes (simulated decode ranks) sending open-loop
lookups of random DP groups at a paced rate. Then:

1. steps the lookup rate (``--steps``, each ``--step-s`` seconds) and reports
   per step the achieved rate, lookup latency p50/p99 and the server's CPU
   (``/proc/PID/stat``); the saturation point is the first step that achieves
   less than 95 % of its target or whose p99 exceeds ``--slo-ms``;
2. runs ``--duration-s`` at ``--lookup-rate`` and restarts the server (a new
   process on the same port, empty registry) half way, and reports the
   lookups that failed (lost, not ready, unknown node, error) and how long
   until lookups were all ready again.

Everything runs on 127.0.0.1, is bounded in processes and time, and stops by
itself. ``--json`` prints one JSON object. Replies are classified by a byte
check, not a full decode, to keep the clients cheap (checked against the
codec once at start).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

from benchmarks.bootstrap_sim import LoadConfig, classify, lookup_client, make_rank, registrar

# --- the server process ------------------------------------------------------------


class ServerProcess:
    def __init__(self, port: int = 0, grace_s: float = 4.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bootstrap", "--host", "127.0.0.1", "--port", str(port),
                                      "--log-level", "ERROR", "--node-grace-s", str(grace_s)],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"bootstrap server did not start: {line!r}")
        self.address = line.split()[-1]
        self.port = int(self.address.rsplit(":", 1)[1])

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server process so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# --- orchestration -------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _merge(parts: list[dict], name: str) -> dict:
    merged = {"latencies_s": []}
    for part in parts:
        for key, value in part[name].items():
            if key == "latencies_s":
                merged[key] += value
            elif key in ("first_ready_after_s", "last_failed_sent_after_s"):
                known = [v for v in (merged.get(key), value) if v is not None]
                merged[key] = (min if key.startswith("first") else max)(known) if known else None
            else:
                merged[key] = merged.get(key, 0) + value
    return merged


def _summary(merged: dict, seconds: float, cpu_s: float, idle_cpu_per_s: float) -> dict:
    """One phase: rates, latency, server CPU (and its part above the
    registrations-only baseline, per lookup answered), clients' CPU."""
    lat = merged.pop("latencies_s")
    answered = len(lat)
    p50, p99 = _percentile(lat, 0.5), _percentile(lat, 0.99)
    extra_s = max(0.0, cpu_s - idle_cpu_per_s * seconds)
    return {**merged, "answered": answered, "achieved_rate": round(answered / seconds, 1),
            "p50_ms": None if p50 is None else round(p50 * 1e3, 3),
            "p99_ms": None if p99 is None else round(p99 * 1e3, 3),
            "server_cpu_percent": round(100 * cpu_s / seconds, 1),
            "server_cpu_us_per_lookup": round(1e6 * extra_s / answered, 1) if answered else None,
            "client_cpu_percent": round(100 * merged.get("client_cpu_s", 0.0) / seconds, 1)}


def _check_classify(cfg: LoadConfig) -> None:
    """The byte check agrees with the codec on every kind of lookup reply."""
    from bootstrap import codec
    from bootstrap.messages import ErrorReply, LookupReply
    group = tuple(make_rank(cfg, i) for i in range(cfg.tp_size))
    common = dict(node_id="prefill-0", dp_rank=0, dp_size=1, tp_size=cfg.tp_size)
    cases = {"ready": LookupReply(**common, ready=True, num_registered=cfg.tp_size, ranks=group),
             "not_ready": LookupReply(**common, ready=False, num_registered=1, ranks=()),
             "unknown_node": LookupReply(**common, ready=False, num_registered=0, ranks=(), unknown_node=True,
                                         known_nodes=tuple(f"prefill-{n:0200d}" for n in range(32))),
             "error": ErrorReply(code="conflict", message="lookup_reply ready")}
    for want, reply in cases.items():
        if classify(codec.encode(reply)) != want:
            raise AssertionError(f"classify() is wrong for a {want} reply")


def run(cfg: LoadConfig) -> dict:
    from bootstrap.client import BootstrapClient
    _check_classify(cfg)
    ctx = mp.get_context("spawn")
    server = ServerProcess()
    out = ctx.Queue()
    t = time.time() + cfg.register_interval_s + 3.0  # children start, every rank registers once
    phases = [("idle", 0.0, t, t + cfg.step_s), ("warmup", 1000.0 / cfg.clients, t + cfg.step_s, t + cfg.step_s + 2)]
    t += cfg.step_s + 2
    for rate in cfg.steps:
        phases.append((f"step-{rate:g}", rate / cfg.clients, t, t + cfg.step_s))
        t += cfg.step_s
    phases.append(("main", cfg.lookup_rate / cfg.clients, t, t + cfg.duration_s))
    restart_at, end = t + cfg.duration_s / 2, t + cfg.duration_s
    num_registrars = max(1, cfg.ranks // 2000)
    per = cfg.ranks // num_registrars
    children = [ctx.Process(target=registrar, args=(cfg, server.address, k * per,
                                                    per if k < num_registrars - 1 else cfg.ranks - k * per,
                                                    end + 0.5, out), daemon=True) for k in range(num_registrars)]
    children += [ctx.Process(target=lookup_client, args=(cfg, server.address, phases, restart_at, seed, out),
                             daemon=True) for seed in range(cfg.clients)]
    for child in children:
        child.start()
    cpu: dict[str, float] = {}
    try:
        for name, _, start, stop in phases:
            time.sleep(max(0.0, start - time.time()))
            if name == phases[2][0]:
                with BootstrapClient(server.address, timeout_s=5) as client:
                    registered = len(client.status().ranks)
            before = server.cpu_s()
            if name == "main":
                time.sleep(max(0.0, restart_at - time.time()))
                before -= server.cpu_s()
                server.stop()
                restarted_at = time.time()
                server = ServerProcess(port=server.port)
                restart_s = time.time() - restarted_at
            time.sleep(max(0.0, stop - time.time()))
            cpu[name] = server.cpu_s() - before
        results = [out.get(timeout=cfg.duration_s + 60) for _ in children]
    finally:
        for child in children:
            child.join(5)
            if child.is_alive():
                child.kill()
        server.stop()
    lookups = [r for kind, r in results if kind == "lookups"]
    registrations = [r for kind, r in results if kind == "registrar"]
    idle_cpu_per_s = cpu["idle"] / cfg.step_s
    steps = [{"target_rate": rate, **_summary(_merge(lookups, name), cfg.step_s, cpu[name], idle_cpu_per_s)}
             for (name, _, _, _), rate in zip(phases[2:], cfg.steps)]
    saturated = next((s["target_rate"] for s in steps if s["achieved_rate"] < 0.95 * s["target_rate"]
                      or (s["p99_ms"] or 0) > cfg.slo_ms), None)
    main = _summary(_merge(lookups, "main"), cfg.duration_s, cpu["main"], idle_cpu_per_s)
    main["target_rate"] = cfg.lookup_rate
    reg_lat = [x for r in registrations for x in r["latencies_s"]]
    return {
        "config": {**asdict(cfg), "steps": list(cfg.steps)}, "ranks_registered_at_start": registered,
        "idle_server_cpu_percent": round(100 * idle_cpu_per_s, 1), "cpu_count": os.cpu_count(),
        "steps": steps, "saturation_rate": saturated,
        "main": {**main, "failed": main["lost"] + main["not_ready"] + main["unknown_node"] + main["error"],
                 "restart_s": round(restart_s, 3), "restart_at_s": cfg.duration_s / 2},
        "registrations": {"sent": sum(r["sent"] for r in registrations),
                          "answered": sum(r["answered"] for r in registrations),
                          "errors": sum(r["errors"] for r in registrations),
                          "p50_ms": round(1e3 * (_percentile(reg_lat, 0.5) or 0), 3),
                          "p99_ms": round(1e3 * (_percentile(reg_lat, 0.99) or 0), 3)},
    }


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def _print(result: dict) -> None:
    c = result["config"]
    print(f"bootstrap load: {c['ranks']} ranks (TP {c['tp_size']}, {c['layers']} MLA layers) re-registering every "
          f"{c['register_interval_s']:g} s; {result['ranks_registered_at_start']} registered at the first step")
    print(f"server CPU with registrations only: {result['idle_server_cpu_percent']:g}% "
          f"({c['ranks'] / c['register_interval_s']:g} registrations/s); {result['cpu_count']} CPUs")
    print(f"{'target/s':>9} {'achieved/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'server CPU':>10} {'us/lookup':>9} "
          f"{'clients CPU':>11} {'lost':>6} {'skipped':>7}")
    for s in result["steps"]:
        print(f"{s['target_rate']:>9g} {s['achieved_rate']:>10g} {s['p50_ms'] or 0:>8.2f} {s['p99_ms'] or 0:>8.2f} "
              f"{s['server_cpu_percent']:>9.0f}% {s['server_cpu_us_per_lookup'] or 0:>9.1f} "
              f"{s['client_cpu_percent']:>10.0f}% {s['lost']:>6} {s['skipped']:>7}")
    print(f"saturation: {result['saturation_rate'] or 'not reached'} lookups/s "
          f"(first step below 95 % of its target or over the p99 SLO of {c['slo_ms']:g} ms)")
    m = result["main"]
    print(f"main: {m['target_rate']:g}/s for {c['duration_s']:g} s, server restarted at {m['restart_at_s']:g} s "
          f"(new one listening after {m['restart_s']:.2f} s): achieved {m['achieved_rate']:g}/s, p50 {m['p50_ms']} ms, "
          f"p99 {m['p99_ms']} ms; failed {m['failed']} of {m['sent']} (lost {m['lost']}, not ready {m['not_ready']}, "
          f"unknown node {m['unknown_node']}, error {m['error']}); first ready reply "
          f"{_s(m['first_ready_after_s'])} s after the restart began, last failed lookup sent "
          f"{_s(m['last_failed_sent_after_s'])} s "
          f"after it")
    r = result["registrations"]
    print(f"registrations: {r['answered']} of {r['sent']} answered, {r['errors']} errors, p50 {r['p50_ms']} ms, "
          f"p99 {r['p99_ms']} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bootstrap_load", description=__doc__.split("\n\n")[0])
    d = LoadConfig()
    p.add_argument("--ranks", type=int, default=d.ranks)
    p.add_argument("--tp-size", type=int, default=d.tp_size)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--register-interval-s", type=float, default=d.register_interval_s)
    p.add_argument("--lookup-rate", type=float, default=d.lookup_rate)
    p.add_argument("--steps", default=",".join(f"{s:g}" for s in d.steps), help="lookup rates to step through")
    p.add_argument("--step-s", type=float, default=d.step_s)
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="the main phase (restart half way)")
    p.add_argument("--clients", type=int, default=d.clients, help="lookup processes")
    p.add_argument("--slo-ms", type=float, default=d.slo_ms)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    cfg = LoadConfig(ranks=a.ranks, tp_size=a.tp_size, layers=a.layers, register_interval_s=a.register_interval_s,
                     lookup_rate=a.lookup_rate, steps=tuple(float(x) for x in a.steps.split(",") if x),
                     step_s=a.step_s, duration_s=a.duration_s, clients=a.clients, slo_ms=a.slo_ms)
    result = run(cfg)
    print(json.dumps(result)) if a.json else _print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
