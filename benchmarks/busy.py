"""``python -m benchmarks.busy``: transfers driven by busy schedulers.

Every system runs its prefill and decode sides in separate processes (or,
``kvferry-one``, kvferry's two managers and one loop in one process, and
``mooncake-one``, raw Mooncake's two engines the same way), each
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
import queue
import subprocess
import sys
import threading
import time
from dataclasses import replace

import numpy as np

from benchmarks.busy_loop import FIRST_ROOM, BusyConfig
from benchmarks.steal import StealWatch
from harness.launch import BootstrapProcess, child_env

WORKLOADS = {
    "short": BusyConfig(pages=32, requests=500, concurrency=1),  # 16 MiB: 512 pieces of 32 KiB
    "8k": BusyConfig(pages=512, requests=12, concurrency=1),  # 8,192 tokens: 256 MiB
    "c64": BusyConfig(pages=32, requests=256, concurrency=64, warmup=64),  # 64 short requests in flight
}
MODES = {"idle": dict(busy_share=0.0, extra_thread=False), "busy": dict(busy_share=1.0, extra_thread=False),
         "busy+thread": dict(busy_share=1.0, extra_thread=True)}
SYSTEMS = ("kvferry", "kvferry-one", "mooncake", "mooncake-one", "nixl", "sglang")
RANK_TIMEOUT_S = 900


class Cell:
    """The rank processes of one cell: spawned with their stdin a pipe, set
    up (each says ``BUSY_READY``), then driven (:meth:`drive`)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(self, role: str, cfg: BusyConfig, *extra: str, python: str = sys.executable,
              module: str = "benchmarks.busy_ranks", env: dict | None = None, base_env: dict | None = None,
              cwd: str | None = None) -> subprocess.Popen:
        """``python -m module role --config CFG extra...``; its environment
        ``base_env`` (None: :func:`child_env`) and ``env``."""
        proc = subprocess.Popen([python, "-m", module, role, "--config", cfg.to_json(), *extra],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**(child_env() if base_env is None else base_env), **(env or {})}, cwd=cwd)
        self.procs.append(proc)
        return proc

    def ready(self, proc: subprocess.Popen, timeout_s: float = 180.0) -> str:
        return _line(proc, "BUSY_READY ", timeout_s)

    def start(self, cfg: BusyConfig, roles: list[str]) -> list[subprocess.Popen]:
        """One rank process per role, each once it said it is ready."""
        ranks = [self.spawn(role, cfg) for role in roles]
        for proc in ranks:
            self.ready(proc)
        return ranks

    def drive(self, cfg: BusyConfig, ranks: list[subprocess.Popen]) -> list[dict]:
        """Feed ``cfg.num_rooms`` requests to every one of ``ranks`` (each
        already ready), ``cfg.concurrency`` at a time, the next once both
        sides said one ended; returns both sides' ``BUSY_RESULT`` dicts."""
        lines: queue.Queue = queue.Queue()
        for proc in ranks:
            threading.Thread(target=_read_lines, args=(proc, lines), daemon=True).start()
        left, open_sides, results, tail = list(range(cfg.num_rooms)), {}, [], []

        def dispatch() -> None:
            room = FIRST_ROOM + left.pop(0)
            open_sides[room] = {"prefill", "decode"}
            for proc in ranks:
                proc.stdin.write(f"{room}\n")
                proc.stdin.flush()

        for _ in range(min(cfg.concurrency, len(left))):
            dispatch()
        deadline, eofs = time.monotonic() + RANK_TIMEOUT_S, 0
        while len(results) < 2:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"cell stalled; {len(open_sides)} rooms open:\n{''.join(tail)}") from None
            if line is None:
                eofs += 1
                if eofs == len(ranks):
                    raise RuntimeError(f"the ranks exited with {len(results)} results:\n{''.join(tail)}")
            elif line.startswith("BUSY_DONE "):
                side, room = line.split()[1:]
                sides = open_sides[int(room)]
                sides.discard(side)
                if not sides:
                    del open_sides[int(room)]
                    if left:
                        dispatch()
                    elif not open_sides:
                        for proc in ranks:
                            proc.stdin.close()  # no more requests: the ranks report and exit
            elif line.startswith("BUSY_RESULT "):
                results.append(json.loads(line[len("BUSY_RESULT "):]))
            else:
                tail = (tail + [line])[-40:]
        return results

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _read_lines(proc: subprocess.Popen, out: queue.Queue) -> None:
    for line in proc.stdout:
        out.put(line)
    out.put(None)


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


def run_cell(system: str, cfg: BusyConfig) -> list[dict]:
    """Both sides' results of one system on one workload and mode."""
    if system == "sglang":
        from benchmarks.busy_sglang import run_sglang_cell
        return run_sglang_cell(cfg)
    cell = Cell()
    try:
        if system in ("kvferry", "kvferry-one"):
            with BootstrapProcess() as server:
                cfg = replace(cfg, bootstrap=server.address)
                roles = ["kvferry-both"] if system == "kvferry-one" else ["kvferry-prefill", "kvferry-decode"]
                return cell.drive(cfg, cell.start(cfg, roles))
        if system == "mooncake-one":
            return cell.drive(cfg, cell.start(cfg, ["mc-both"]))
        engine = {"mooncake": "mc", "nixl": "nixl"}[system]
        env = {"UCX_NET_DEVICES": "lo"} if engine == "nixl" else {}
        decode = cell.spawn(f"{engine}-decode", cfg, env=env)
        peer = cell.ready(decode, 120).strip()
        prefill = cell.spawn(f"{engine}-prefill", cfg, "--peer", peer, env=env)
        cell.ready(prefill)
        return cell.drive(cfg, [decode, prefill])
    finally:
        for proc in cell.procs:
            if proc.poll() is None and proc.stdin and not proc.stdin.closed:
                proc.stdin.close()
        cell.close()


def summarize(cfg: BusyConfig, results: list[dict], steal: StealWatch | None = None) -> dict:
    """Latency (ms; p50, p99, p99.9, max) over the measured rooms, from
    decode opening a room to both sides seeing it end; its two splits
    (decode opened -> prefill sent, prefill sent -> both ended), their
    medians; the ten slowest rooms' timelines, each with the most steal one
    CPU saw in its window (``steal``: the cell's :class:`StealWatch`); GB/s."""
    by_role = {r["role"]: r for r in results}
    pre, dec = by_role["prefill"], by_role["decode"]
    failed = sorted(set(pre.get("failed", [])) | set(dec.get("failed", [])))
    if failed:  # a failed room's quick end is no latency: the cell is reported as failed
        why = sorted(set(pre.get("errors", [])) | set(dec.get("errors", [])))
        raise RuntimeError(f"{len(failed)} of {cfg.num_rooms} rooms failed: {'; '.join(why)[:1000]}")
    rooms = sorted(int(r) for r in dec["created"])[cfg.warmup:]
    timelines = []
    for r in rooms:
        k = str(r)
        t0 = dec["created"][k]
        end = max(pre["done"][k], dec["done"][k])
        sent = pre.get("sent", {}).get(k, pre["created"][k])
        timelines.append({"room": r, "ms": (end - t0) * 1e3, "to_send_ms": (sent - t0) * 1e3,
                          "send_to_done_ms": (end - sent) * 1e3, "prefill_opened_ms": (pre["created"][k] - t0) * 1e3,
                          "prefill_done_ms": (pre["done"][k] - t0) * 1e3, "decode_done_ms": (dec["done"][k] - t0) * 1e3,
                          "at_s": t0 - dec["created"][str(rooms[0])], "window": (t0, end)})
    lat = np.array([t["ms"] for t in timelines])
    span = max(t["at_s"] + t["ms"] / 1e3 for t in timelines)
    slowest = sorted(timelines, key=lambda t: -t["ms"])[:10]
    for t in slowest:  # the steal of the reported rooms' windows only
        t["steal_ms"] = steal.within(*t.pop("window")) if steal is not None else 0.0
    r1 = lambda x: round(float(x), 1)  # noqa: E731
    return {"p50_ms": r1(np.percentile(lat, 50)), "p99_ms": r1(np.percentile(lat, 99)),
            "p999_ms": r1(np.percentile(lat, 99.9)), "max_ms": r1(lat.max()),
            "to_send_p50_ms": r1(np.median([t["to_send_ms"] for t in timelines])),
            "send_to_done_p50_ms": r1(np.median([t["send_to_done_ms"] for t in timelines])),
            # send -> done in its two legs: the bytes (and prefill seeing them land), then decode being told
            "send_to_prefill_done_p50_ms": r1(np.median([t["prefill_done_ms"] - t["to_send_ms"] for t in timelines])),
            "prefill_to_decode_done_p50_ms": r1(np.median([t["decode_done_ms"] - t["prefill_done_ms"] for t in timelines])),
            "slowest": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in t.items()} for t in slowest],
            "requests": len(rooms), "gbps": round(cfg.request_bytes * len(rooms) / span / 1e9, 3),
            "cpu_s": round(sum(r.get("cpu_s", 0.0) for r in results), 3),
            "steal_ms": round(steal.total_ms(), 1) if steal is not None else 0.0,
            "control_msgs_per_request": round(sum(r.get("control_msgs", 0) for r in results) / cfg.num_rooms, 2),
            **_periodic(results)}


def _periodic(results: list[dict]) -> dict:
    """kvferry's ranks: each periodic task's longest round in CPU ms and its
    rounds (both sides), the rank processes' garbage collections, and with
    ``--explain`` their reference threads' blocks (the machine's own addition
    to any hold: :class:`~benchmarks.busy_explain.ReferenceHolds`; :func:`_reference`);
    absent for the raw engines."""
    if not any("periodic_max_cpu_ms" in r for r in results):
        return {}
    rounds: dict[str, int] = {}
    for r in results:
        for task, n in r.get("periodic_rounds", {}).items():
            rounds[task] = rounds.get(task, 0) + n
    return {"periodic_max_cpu_ms": _longest_by_task(results), "periodic_rounds": rounds,
            "periodic_max_ms_by_kind": _longest_by_kind(results),
            "gc_max_ms": round(max(r.get("gc_max_ms", 0.0) for r in results), 3),
            "gc_collections": sum(r.get("gc_collections", 0) for r in results),
            "gc_by_generation": [sum(r.get("gc_by_generation", [0, 0, 0])[g] for r in results) for g in range(3)],
            "gc_collected": sum(r.get("gc_collected", 0) for r in results),
            # each process's slowest loop iterations, by its first side's role (kvferry-one: prefill)
            "loop_slowest": {r["role"]: r["loop_slowest"] for r in results if "loop_slowest" in r},
            **{key: [max(r.get(key, [0.0] * 3)[g] for r in results) for g in range(3)]
               for key in ("gc_max_ms_by_generation", "gc_max_cpu_ms_by_generation")},
            **_reference(results)}


def _reference(rows: list[dict]) -> dict:
    """The rank processes' slices over 1 ms (:func:`benchmarks.busy_explain.long_slices`),
    and their reference threads' blocks: the longest, how many, those over 1 ms
    (with the steal, softirq and irq ticks that advanced in each), and how many
    of the others saw each tick advance; absent unless the ranks explained
    (``--explain``)."""
    if not any("reference_blocks" in r for r in rows):
        return {}
    ticked: dict[str, int] = {}
    for r in rows:
        for k, n in r.get("reference_ticked", {}).items():
            ticked[k] = ticked.get(k, 0) + n
    return {"reference_max_cpu_ms": round(max(r.get("reference_max_cpu_ms", 0.0) for r in rows), 3),
            "long_slices": [b for r in rows for b in r.get("long_slices", [])],
            "reference_blocks": sum(r.get("reference_blocks", 0) for r in rows),
            "reference_slow": [b for r in rows for b in r.get("reference_slow", [])], "reference_ticked": ticked}


def _longest_by_task(rows: list[dict], pick=lambda r: r.get("periodic_max_cpu_ms", {})) -> dict[str, float]:
    """Each periodic task's longest round (ms) over ``rows``' ``periodic_max_cpu_ms`` (or what ``pick`` takes)."""
    tasks = sorted({t for r in rows for t in pick(r)})
    return {t: round(max(pick(r).get(t, 0.0) for r in rows), 3) for t in tasks}


def _longest_by_kind(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Each periodic task's longest round (ms) of each kind (``whole``, ``preempted``, ``waited``:
    :data:`transfer.round_times.HOLD_KINDS`) over ``rows``' ``periodic_max_ms_by_kind``."""
    kinds = sorted({k for r in rows for k in r.get("periodic_max_ms_by_kind", {})})
    return {k: _longest_by_task(rows, lambda r, k=k: r.get("periodic_max_ms_by_kind", {}).get(k, {})) for k in kinds}


_MEDIANED = ("p50_ms", "p99_ms", "p999_ms", "max_ms", "to_send_p50_ms", "send_to_done_p50_ms",
             "send_to_prefill_done_p50_ms", "prefill_to_decode_done_p50_ms", "gbps", "cpu_s", "control_msgs_per_request")


def _median(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r] or rows
    out = dict(ok[0])
    for key in _MEDIANED:
        out[key] = round(float(np.median([r[key] for r in ok])), 3)
    out["rounds"] = len(ok)
    out["all_p50_ms"] = [r["p50_ms"] for r in ok]
    out["all_p99_ms"] = [r["p99_ms"] for r in ok]
    out["all_max_ms"] = [r["max_ms"] for r in ok]
    out["all_steal_ms"] = [r.get("steal_ms", 0.0) for r in ok]
    if any("periodic_max_cpu_ms" in r for r in ok):  # the longest of every round, not the first round's
        out["periodic_max_cpu_ms"] = _longest_by_task(ok)
        out["periodic_max_ms_by_kind"] = _longest_by_kind(ok)
        out["gc_max_ms"] = max(r.get("gc_max_ms", 0.0) for r in ok)
        out.update(_reference(ok))
    return out


def sglang_available() -> str:
    """Why SGLang's backend cannot run here ("" when it can)."""
    py = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-sglang", "bin", "python")
    return "" if os.path.exists(py) else "no .venv-sglang (make setup-sglang builds it)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.busy", description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--requests", type=int, help="override every workload's request count")
    ap.add_argument("--rounds", type=int, default=1, help="runs per cell, interleaved; medians reported")
    ap.add_argument("--explain", action="store_true",
                    help="kvferry's ranks explain their slices over 1 ms and run a reference thread (docs/threads.md); "
                         "that thread costs kvferry's cells latency, so tables against the other systems run without")
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
            cfg = replace(base, **MODES[mode], explain=args.explain)
            runs: dict[str, list[dict]] = {s: [] for s in systems}
            for _ in range(args.rounds):
                for system in systems:
                    row = {"workload": wname, "mode": mode, "system": system, "request_mib": cfg.request_bytes >> 20}
                    try:
                        with StealWatch() as steal:
                            results = run_cell(system, cfg)
                        row.update(summarize(cfg, results, steal))
                    except Exception as exc:  # a cell that fails is reported, the run goes on
                        row.update({k: float("nan") for k in _MEDIANED}, error=f"{type(exc).__name__}: {exc}"[:2000])
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
    print(f"{'workload':8} {'mode':12} {'system':12} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>7} "
          f"{'->send':>7} {'send->':>7} {'GB/s':>7} {'msgs/req':>9}   (ms)")
    for r in rows:
        print(f"{r['workload']:8} {r['mode']:12} {r['system']:12} {r['p50_ms']:7.1f} {r['p99_ms']:7.1f} "
              f"{r['p999_ms']:7.1f} {r['max_ms']:7.1f} {r['to_send_p50_ms']:7.1f} {r['send_to_done_p50_ms']:7.1f} "
              f"{r['gbps']:7.3f} {r['control_msgs_per_request']:9.2f}"
              + (f"  {r['error'][:60]}" if "error" in r else ""))
    for r in rows:
        if r.get("periodic_max_cpu_ms"):
            longest = ", ".join(f"{t} {v:.2f}" for t, v in r["periodic_max_cpu_ms"].items())
            reference = f"reference {r['reference_max_cpu_ms']:.2f}; " if r.get("reference_blocks") else ""
            whole = ", ".join(f"{t} {v:.2f}" for t, v in r.get("periodic_max_ms_by_kind", {}).get("whole", {}).items())
            print(f"longest rounds of {r['workload']} {r['mode']} {r['system']} (CPU ms): {longest}; "
                  f"with no context switch inside: {whole}; "
                  f"{reference}process GC {r.get('gc_max_ms', 0.0):.2f}"
                  + (f" (collections by generation {'/'.join(map(str, r['gc_by_generation']))}, "
                     f"{r.get('gc_collected', 0)} objects found unreachable; longest by generation "
                     f"{'/'.join(f'{v:.2f}' for v in r['gc_max_ms_by_generation'])} ms, of CPU "
                     f"{'/'.join(f'{v:.2f}' for v in r['gc_max_cpu_ms_by_generation'])})"
                     if "gc_by_generation" in r else ""))
            slow, ticked = r.get("reference_slow", []), r.get("reference_ticked", {})
            if r.get("reference_blocks"):
                print(f"  reference blocks {r['reference_blocks']}, over 1 ms {len(slow)} (steal advanced in "
                      f"{sum(b['steal'] > 0 for b in slow)}, softirq {sum(b['softirq'] > 0 for b in slow)}); "
                      f"under it, steal advanced in {ticked.get('steal', 0)}, softirq {ticked.get('softirq', 0)}"
                      + "".join(f"; {b['cpu_ms']}/{b['wall_ms']} ms s{b['steal']} q{b['softirq']}" for b in slow[:5]))
            for role, its in r.get("loop_slowest", {}).items():
                if its:  # the process's slowest loop iteration, by part (kvferry-one: one process, named prefill)
                    parts = ", ".join(f"{k} {v:.1f}" for k, v in its[0].items() if k not in ("ms", "at_s"))
                    print(f"  {role}'s slowest loop iteration: {its[0]['ms']:.1f} ms ({parts}) at {its[0]['at_s']:.1f} s")
            for b in r.get("long_slices", []):
                print(f"  slice over 1 ms: {b['task']} {b.get('from', '')}-{b.get('to', '')} {b['cpu_ms']:.2f} ms "
                      f"of CPU in {b['wall_ms']:.2f}; steal +{b['steal']}, softirq +{b['softirq']}, irq +{b['irq']} "
                      f"ticks; switches {b['voluntary']} voluntary, {b['involuntary']} involuntary; "
                      f"{b['minor_faults']} minor faults")
    for r in rows:
        if r.get("slowest"):
            print(f"slowest of {r['workload']} {r['mode']} {r['system']} (ms from decode's open: prefill opened, "
                  f"sent, prefill done, decode done; at s into the run; the most steal of one CPU in its window; "
                  f"{r.get('steal_ms', 0.0):.0f} ms of steal in the cell, all CPUs):")
            for t in r["slowest"]:
                print(f"  room {t['room']}: {t['ms']:.1f} = {t['prefill_opened_ms']:.1f} / {t['to_send_ms']:.1f} / "
                      f"{t['prefill_done_ms']:.1f} / {t['decode_done_ms']:.1f}  at {t['at_s']:.2f}  "
                      f"steal {t.get('steal_ms', 0.0):.0f}")


if __name__ == "__main__":
    sys.exit(main())
