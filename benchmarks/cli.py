"""``python -m benchmarks``: kvferry side by side with raw Mooncake and the
machine's limits, in one run.

Each workload runs these ways (rows of ``mode`` ``kvferry``, ``mooncake`` and
``limit``; a ``baseline`` field tells the rows of one mode apart):

- ``kvferry``: a bootstrap server, prefill and decode processes, the whole
  path (lookup, handshake, planning, transfer, completion messages);
- ``mooncake``, ``baseline="merged"``: the same bytes per request between two
  processes through the bare transfer engine at its best pattern (large
  entries from one contiguous buffer into another, submit and sleep-poll),
  the best of a few entry sizes;
- ``mooncake``, ``baseline="same-pages"`` (scattered workloads, TP 1 -> 1):
  the bare engine writing exactly the pages a kvferry request writes, between
  pools of kvferry's geometry, one descriptor per run of pages adjacent on
  both sides, no staging buffer (see :mod:`benchmarks.raw_pages`);
- ``limit``: a plain TCP stream of the same bytes to the decode side (TCP
  only; on RDMA raw Mooncake is the limit), and a memcpy on this host;
- ``nixl`` (``nixl-merged``, ``nixl-pages``): the same two raw baselines
  through bare NIXL agents on UCX, and ``kvferry-nixl``: kvferry's ranks on
  the NIXL transport (see :mod:`benchmarks.nixl_runs`), each once per
  ``--ucx-tls`` value (default: UCX's own choice, then ``UCX_TLS=tcp``).

Every row names its ``transport`` (and ``ucx_tls`` for NIXL). With the
workloads of issue 18's targets in the run, the targets are evaluated and
printed, and stored under ``targets`` in the JSON (:mod:`benchmarks.targets`).

Two hosts: ``python -m benchmarks agent --host H --port P`` on the decode
node, then ``python -m benchmarks --peer H:P --protocol rdma --hostname
<this node's IP> --peer-hostname <its IP> [--device mlx5_0]`` here: the
prefill side runs here, the decode side through the agent
(:mod:`benchmarks.agent`).

Timings leave out one warm-up request (connection set-up). ``--quick`` runs
a short-prompt and a long-prompt subset; ``--json PATH`` writes the figures.

``--storage`` runs the storage tier's backends instead (write-through and
prefetch of each, and the memcpy and file-system limits; see
:mod:`benchmarks.storage`), ``--storage-pages`` pages each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from dataclasses import asdict, dataclass, replace

from benchmarks import agent, storage, targets
from benchmarks.hosts import LocalHost, Link, machine
from benchmarks.nixl_runs import kvferry_nixl_missing, run_kvferry_nixl, run_nixl, run_nixl_pages
from benchmarks.runs import run_kvferry, run_limits, run_mooncake, run_mooncake_pages
from benchmarks.workloads import DRAFT, FULL, MODELS, PAGE_SIZE, QUICK, Workload

__all__ = ["DRAFT", "FULL", "MODELS", "PAGE_SIZE", "QUICK", "Workload", "main", "print_table"]


MODES = ("kvferry", "mooncake", "mooncake-merged", "mooncake-pages", "limit",
         "nixl", "nixl-merged", "nixl-pages", "kvferry-nixl")


def _ratios(row: dict, refs: dict[str, float]) -> str:
    out = []
    for baseline, gbps in refs.items():
        if gbps and row["mode"] == "kvferry":
            paired = row.get(f"paired_ratio_{baseline.replace('-', '_')}")
            out.append(f"{row['gbps'] / gbps:.0%} of mooncake {baseline}"
                       + (f" (rounds paired: {paired:.0%})" if paired is not None and row.get("rounds", 1) > 1 else ""))
    return ", ".join(out)


def _transport(row: dict) -> str:
    tls = row.get("ucx_tls")
    return row.get("transport", "") + (f" tls={tls}" if tls else "")


def print_table(rows: list[dict]) -> None:
    head = f"{'workload':<20} {'mode':<12} {'transport':<20} {'tokens':>6} {'conc':>4} {'GB/s':>6} {'p50 ms':>9} " \
           f"{'p99 ms':>9} {'desc/req':>9} {'msgs/req':>8} {'CPU s/GB':>8}  note"
    print(head)
    print("-" * len(head))
    refs: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["mode"] == "mooncake":
            refs.setdefault(r["workload"], {})[r["baseline"]] = r["gbps"]
    for r in rows:
        note = r.get("baseline", "")
        if r["mode"] in ("kvferry", "kvferry-nixl"):
            note = _ratios(r, refs.get(r["workload"], {}))
        elif r.get("baseline") == "merged":
            note = f"merged, entries of {r['entry_bytes'] >> 10} KiB"
        elif r.get("baseline") == "same-pages":
            note = f"same pages, {r['pattern']} pattern"
        msgs = r.get("control_msgs_per_request", "")
        cpu = r.get("cpu_s_per_gb", "")
        print(f"{r['workload']:<20} {r['mode']:<12} {_transport(r):<20} {r['tokens']:>6} {r['concurrency']:>4} "
              f"{r['gbps']:>6.2f} "
              f"{r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f} {r['descriptors_per_request']:>9.0f} "
              f"{msgs!s:>8} {cpu!s:>8}  {note}", flush=True)


def _median(runs: list[dict]) -> dict:
    median = sorted(runs, key=lambda r: r["gbps"])[len(runs) // 2]
    return dict(median, rounds=len(runs), gbps_all=[r["gbps"] for r in runs],
                load_1m_all=[r.get("load_1m") for r in runs])


def _add_paired_ratios(row: dict, runs: dict[str, list[dict]]) -> None:
    """kvferry's throughput over each raw baseline's in the same round (they
    run back to back), median over the rounds: steadier on a noisy machine
    than the ratio of the two medians."""
    for baseline in ("merged", "same-pages"):
        ratios = sorted(k["gbps"] / r["gbps"] for k, r in zip(runs["kvferry"], runs[baseline]) if r["gbps"])
        if ratios:
            row[f"paired_ratio_{baseline.replace('-', '_')}"] = round(ratios[len(ratios) // 2], 3)


@dataclass(frozen=True, kw_only=True)
class Options:
    modes: frozenset[str]
    rounds: int
    quick: bool  # one entry size and one submit pattern for the raw baselines
    ucx_tls: tuple[str, ...] = ("default", "tcp")  # the NIXL modes run once per value
    nixl_progress_delay_us: int = 100
    limits_each_round: bool = False  # the limits alternate with the modes too (median kept), not once at the end


def run_workload(w: Workload, options: Options, decode, link: Link) -> list[dict]:
    """Every mode of ``w``: kvferry and the raw baselines alternately
    ``options.rounds`` times (each keeps its median run), then the limits."""
    modes = options.modes
    entry_sizes = [4 << 20] if options.quick else [1 << 20, 4 << 20, 16 << 20]
    patterns = ["submit"] if options.quick else ["submit", "batch"]
    runs: dict[str, list[dict]] = {"kvferry": [], "merged": [], "same-pages": []}
    nixl_entries = {tls: list(entry_sizes) for tls in options.ucx_tls}
    for _ in range(options.rounds):
        if "kvferry" in modes:
            runs["kvferry"].append(run_kvferry(w, decode, link))
        if modes & {"mooncake", "mooncake-merged"}:
            best = run_mooncake(w, decode, link, entry_sizes)
            entry_sizes = [best["entry_bytes"]]  # later rounds reuse the best entry size
            runs["merged"].append(best)
        if modes & {"mooncake", "mooncake-pages"} and w.has_same_pages_baseline and w.device == "cpu":
            best = run_mooncake_pages(w, decode, link, patterns)
            patterns = [best["pattern"]]  # ... and the best pattern
            runs["same-pages"].append(best)
        for tls in options.ucx_tls:
            _nixl_round(w, options, decode, link, tls, nixl_entries, runs)
        if "limit" in modes and options.limits_each_round:
            for limit in run_limits(w, decode, link):
                runs.setdefault(f"limit/{limit['baseline']}", []).append(limit)
    rows = [_median(mode_runs) for mode_runs in runs.values() if mode_runs]
    if runs["kvferry"]:
        _add_paired_ratios(rows[0], runs)
    if "limit" in modes and not options.limits_each_round:
        rows.extend(run_limits(w, decode, link))
    return rows


def _nixl_round(w: Workload, options: Options, decode, link: Link, tls: str, entries: dict, runs: dict) -> None:
    """One round of the NIXL modes under one UCX transport selection."""
    modes, delay = options.modes, options.nixl_progress_delay_us
    if "kvferry-nixl" in modes and not kvferry_nixl_missing():
        runs.setdefault(f"kvferry-nixl/{tls}", []).append(run_kvferry_nixl(w, decode, link, tls))
    if w.device != "cpu" or link.protocol != "tcp":
        return  # the raw NIXL baselines: host memory, this host's UCX choice
    if modes & {"nixl", "nixl-merged"}:
        best = run_nixl(w, decode, link, entries[tls], tls, delay)
        entries[tls] = [best["entry_bytes"]]
        runs.setdefault(f"nixl-merged/{tls}", []).append(best)
    if modes & {"nixl", "nixl-pages"} and w.has_same_pages_baseline:
        runs.setdefault(f"nixl-pages/{tls}", []).append(run_nixl_pages(w, decode, link, tls, delay))


def _machines(link: Link, decode) -> dict:
    """This host; with a peer, both (each with its address and role)."""
    here = machine()
    if isinstance(decode, LocalHost):
        return here
    return dict(here, role="prefill", address=link.hostname,
                peer=dict(decode.machine, role="decode", address=link.peer_hostname, agent=decode.name))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["agent"]:
        return agent.main(argv[1:])
    if argv[:1] == ["metrics-cost"]:
        from benchmarks import metrics_cost
        return metrics_cost.main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description="kvferry benchmark (see the module docstring); "
                                             "'python -m benchmarks agent --help' for the decode node's agent")
    ap.add_argument("--quick", action="store_true", help="a short and a long prompt subset, under 2 minutes")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ap.add_argument("--only", help="comma-separated workload names")
    ap.add_argument("--modes", default="kvferry,mooncake,limit",
                    help="comma-separated: kvferry, mooncake (both raw baselines), mooncake-merged, "
                         "mooncake-pages, limit, nixl (both raw NIXL baselines), nixl-merged, nixl-pages, "
                         "kvferry-nixl")
    ap.add_argument("--ucx-tls", default="default,tcp",
                    help="the NIXL modes run once per value: 'default' (UCX picks, same-host shortcuts "
                         "included) or a UCX_TLS value such as 'tcp' (default %(default)s)")
    ap.add_argument("--limits-each-round", action="store_true",
                    help="measure the limits in every round too (median kept): the targets compare against them")
    ap.add_argument("--nixl-progress-delay-us", type=int, default=100,
                    help="raw NIXL: the UCX progress threads' poll delay (NIXL's Python API: 0, a busy spin)")
    ap.add_argument("--requests", type=int, help="override every workload's request count")
    ap.add_argument("--rounds", type=int, default=None,
                    help="run kvferry and raw Mooncake alternately this many times and keep each one's "
                         "median run (default 3, 1 with --quick): this machine's runs vary by 20-40%%")
    two = ap.add_argument_group("two hosts (the decode side through an agent on the peer)")
    two.add_argument("--peer", metavar="HOST:PORT", help="the agent on the decode node (default: all here)")
    two.add_argument("--protocol", choices=["tcp", "rdma"], default="tcp", help="Mooncake's transport")
    two.add_argument("--hostname", default="127.0.0.1", help="this (prefill) node's address, as the peer reaches it")
    two.add_argument("--peer-hostname", help="the decode node's address (default: --peer's host, or --hostname)")
    two.add_argument("--device", default="", help="this node's RDMA NIC (default: the engine picks)")
    two.add_argument("--peer-device", help="the decode node's RDMA NIC (default: --device)")
    ap.add_argument("--pool-device", default="cpu",
                    help="where the KV pools live: cpu (default), cuda or cuda:N; on CUDA the raw Mooncake "
                         "baseline uses CUDA buffers too, the same-pages baseline is left out, and the limits "
                         "gain a device-to-device copy row (--device names the RDMA NIC)")
    store = ap.add_argument_group("storage (instead of the transfer workloads)")
    store.add_argument("--storage", action="store_true",
                       help="write-through and prefetch with each storage backend (file, Mooncake Store, "
                            "NIXL POSIX) and the memcpy and file-system limits; about 20 s on 2 cores")
    store.add_argument("--storage-pages", type=int, default=storage.DEFAULT_PAGES,
                       help="pages (2 MiB each) per backend (default %(default)s)")
    store.add_argument("--storage-backends", default=",".join(storage.BACKENDS),
                       help="comma-separated, of %(default)s")
    args = ap.parse_args(argv)
    if args.storage:
        if args.peer:
            ap.error("--storage runs on this host only; leave out --peer")
        return _main_storage(args, ap)
    workloads = QUICK if args.quick else FULL
    if args.only:
        wanted = set(args.only.split(","))
        workloads = [w for w in FULL if w.name in wanted]
    if args.requests:
        workloads = [replace(w, requests=args.requests) for w in workloads]
    if args.pool_device != "cpu":
        if args.peer:
            ap.error("--pool-device runs on this host only for now; leave out --peer")
        workloads = [replace(w, device=args.pool_device) for w in workloads]
    modes = frozenset(args.modes.split(","))
    unknown = modes - set(MODES)
    if unknown:
        ap.error(f"unknown modes: {', '.join(sorted(unknown))}")
    options = Options(modes=modes, rounds=args.rounds or (1 if args.quick else 3), quick=args.quick,
                      ucx_tls=tuple(args.ucx_tls.split(",")), nixl_progress_delay_us=args.nixl_progress_delay_us,
                      limits_each_round=args.limits_each_round)
    missing = {"kvferry-nixl": kvferry_nixl_missing()} if "kvferry-nixl" in modes else {}
    missing = {mode: why for mode, why in missing.items() if why}
    for mode, why in missing.items():
        print(f"{mode}: not run: {why}", flush=True)
    peer_host = args.peer.rpartition(":")[0] if args.peer else args.hostname
    link = Link(protocol=args.protocol, hostname=args.hostname, peer_hostname=args.peer_hostname or peer_host,
                device=args.device, peer_device=args.device if args.peer_device is None else args.peer_device)
    # SIGTERM unwinds like Ctrl-C: every process started here, and the agent's session, is ended.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    decode = agent.AgentHost(args.peer) if args.peer else LocalHost()
    rows: list[dict] = []
    try:
        for w in workloads:
            rows += run_workload(w, options, decode, link)
            print_table([r for r in rows if r["workload"] == w.name])
            print()
        machines = _machines(link, decode)
    finally:
        decode.close()
    print_table(rows)
    evaluated = targets.evaluate(rows) if {w.name for w in workloads} & set(targets.WORKLOADS) else []
    if evaluated:
        print()
        targets.print_targets(evaluated)
    for mode, why in missing.items():
        print(f"{mode}: not run: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machines, "transport": link.protocol, "link": asdict(link), "rows": rows,
                       "targets": evaluated, "missing": missing, "load_average": _load_average()}, f, indent=1)
    return 0


def _load_average() -> list[float]:
    """1, 5 and 15 minute load averages at the end of the run (the machine may be shared)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _main_storage(args, ap: argparse.ArgumentParser) -> int:
    try:
        config = storage.StorageBenchConfig(num_pages=args.storage_pages,
                                                  backends=tuple(args.storage_backends.split(",")))
    except ValueError as exc:
        ap.error(str(exc))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the Mooncake processes are stopped
    rows, skipped = storage.run_storage(config)
    storage.print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "storage": {"skipped": skipped}, "rows": rows}, f, indent=1)
    return 0

