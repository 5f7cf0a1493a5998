"""How much of kvferry's long slices was the kernel's (benchmark only).

A periodic round's slice is measured on its thread's CPU clock
(:mod:`transfer.round_times`). This kernel is built without
``CONFIG_IRQ_TIME_ACCOUNTING``: the interrupts and softirqs a CPU serves
(the loopback TCP stack's, the timer's, other CPUs' calls) are charged to
whichever thread is on it, and a slice's clock counts them as its own.
Whether they, or something else, made a slice long is what this traces
(docs/threads.md, "What the kernel saw": mostly something else).

``python -m benchmarks.hold_trace [--sample HZ] [--keep DIR] [--json PATH]
-- BUSY_ARGS`` runs ``python -m benchmarks.busy --explain BUSY_ARGS`` under
``perf record -a`` with the kernel's interrupt tracepoints (hard IRQs, the
APIC's vectors, softirqs; timestamps on ``CLOCK_MONOTONIC``, the clock the
slices are marked with), then splits every slice over 1 ms (and every
reference block over 1 ms) into the interrupt time that ran on its thread
inside it and what is left, the thread's own. With ``--sample`` every CPU's
call chains are sampled too (``cpu-clock`` at HZ per CPU), and each slice
gets its thread's samples inside it: how many (about HZ / 1000 per ms on a
CPU), how many in the kernel, the commonest leaf functions and system
calls. It prints one line per slice and writes the rows as JSON
(``--json``). Needs root (``perf`` with tracepoints, system-wide).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

#: The tracepoints: each entry with the exit that ends it.
TRACEPOINTS = {
    "irq:irq_handler_entry": "irq:irq_handler_exit",
    "irq:softirq_entry": "irq:softirq_exit",
    "irq_vectors:local_timer_entry": "irq_vectors:local_timer_exit",
    "irq_vectors:call_function_entry": "irq_vectors:call_function_exit",
    "irq_vectors:call_function_single_entry": "irq_vectors:call_function_single_exit",
    "irq_vectors:reschedule_entry": "irq_vectors:reschedule_exit",
}  # irq_vectors:irq_work_exit cannot be enabled on this kernel (perf: "No permission"), so irq_work is left out
_EXITS = {exit_: entry for entry, exit_ in TRACEPOINTS.items()}

# perf script -F tid,cpu,time,event,trace --ns:  "  1234 [001]  8043.161241583:  irq:softirq_entry: vec=3 [action=NET_RX]"
_LINE = re.compile(r"^\s*(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(cpu-clock\S*?|[\w:]+):\s*(.*)$")
_ACTION = re.compile(r"action=(\w+)|name=(\S+)")


class Spans:
    """The interrupt time that ran on each thread: per thread id, sorted
    spans ``(start_s, end_s, what)``, outermost only (an IRQ inside a
    softirq is part of the softirq's span, not counted twice)."""

    def __init__(self) -> None:
        self.by_tid: dict[int, list[tuple[float, float, str]]] = {}
        #: per thread id, ``(time_s, call chain, leaf first)`` of each CPU sample (``--sample``)
        self.samples: dict[int, list[tuple[float, list[str]]]] = {}

    @classmethod
    def parse(cls, lines) -> Spans:
        """From ``perf script -F tid,cpu,time,event,trace,ip,sym,dso --ns``
        lines; a ``cpu-clock`` sample's call chain (the indented lines after
        it) is kept in ``samples``."""
        spans = cls()
        open_: dict[int, list[tuple[int, float, str]]] = {}  # cpu -> stack of (tid, start, what)
        chain: list[str] | None = None
        for line in lines:
            if line.startswith("\t"):
                if chain is not None:
                    parts = line.split()
                    chain.append(f"{parts[1]}{'' if parts[-1] != '([kernel.kallsyms])' else ' [k]'}"
                                 if len(parts) > 1 else "?")
                continue
            chain = None
            m = _LINE.match(line)
            if not m:
                continue
            tid, cpu, at, event, rest = int(m[1]), int(m[2]), float(m[3]), m[4], m[5]
            if event.startswith("cpu-clock"):
                chain = []
                spans.samples.setdefault(tid, []).append((at, chain))
                continue
            stack = open_.setdefault(cpu, [])
            if event in TRACEPOINTS:
                a = _ACTION.search(rest)
                what = event.split(":")[1].removesuffix("_entry")
                stack.append((tid, at, f"{what}:{a[1] or a[2]}" if a else what))
            elif event in _EXITS and stack:
                tid0, start, what = stack.pop()
                if not stack:
                    spans.by_tid.setdefault(tid0, []).append((start, at, what))
        for spans_ in spans.by_tid.values():
            spans_.sort()
        for samples in spans.samples.values():
            samples.sort(key=lambda s: s[0])
        return spans

    def sampled(self, tid: int, start_s: float, end_s: float) -> dict:
        """Thread ``tid``'s CPU samples between ``start_s`` and ``end_s``:
        how many, how many in the kernel, and the commonest leaf functions
        and system calls."""
        samples = self.samples.get(tid, [])
        i = bisect.bisect_left(samples, start_s, key=lambda s: s[0])
        inside = [c for t, c in samples[i:bisect.bisect_right(samples, end_s, key=lambda s: s[0])]]
        leaves, calls = Counter(c[0] for c in inside if c), Counter()
        for c in inside:
            call = next((f for f in c if f.startswith(("__x64_sys_", "__do_sys_", "asm_exc_page_fault"))), None)
            if call:
                calls[call] += 1
        return {"samples": len(inside), "in_kernel": sum(1 for c in inside if c and c[0].endswith(" [k]")),
                "leaves": dict(leaves.most_common(5)), "syscalls": dict(calls.most_common(3))}

    def inside(self, tid: int, start_s: float, end_s: float) -> tuple[float, dict[str, float]]:
        """The interrupt seconds that ran on thread ``tid`` between
        ``start_s`` and ``end_s``, and the same by kind."""
        spans = self.by_tid.get(tid, [])
        total, kinds = 0.0, {}
        i = bisect.bisect_left(spans, (start_s - 1.0,))  # no span lasts a second
        for s, e, what in spans[i:]:
            if s >= end_s:
                break
            overlap = min(e, end_s) - max(s, start_s)
            if overlap > 0:
                total += overlap
                kinds[what] = kinds.get(what, 0.0) + overlap
        return total, kinds


def split(row: dict, spans: Spans) -> dict:
    """A long slice (or reference block) with the interrupt time inside it
    and the thread's own time (its CPU time less that), in ms."""
    irq_s, kinds = spans.inside(row["tid"], row["start_s"], row["end_s"])
    top = sorted(kinds.items(), key=lambda kv: -kv[1])[:4]
    return {**row, "irq_ms": round(irq_s * 1e3, 3), "own_ms": round(row["cpu_ms"] - irq_s * 1e3, 3),
            "irq_by_kind_ms": {k: round(v * 1e3, 3) for k, v in top},
            **({"sampled": spans.sampled(row["tid"], row["start_s"], row["end_s"])} if spans.samples else {})}


def _rows(busy_json: dict) -> list[dict]:
    out = []
    for r in busy_json["rows"]:
        cell = f"{r['workload']} {r['mode']} {r['system']}"
        out += [{"cell": cell, "kind": "slice", **b} for b in r.get("long_slices", []) if "tid" in b]
        out += [{"cell": cell, "kind": "reference", "task": "reference", **b}
                for b in r.get("reference_slow", []) if "tid" in b]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hold_trace", description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="PATH", help="the split rows")
    ap.add_argument("--keep", metavar="DIR", help="keep perf.data and busy.json here")
    ap.add_argument("--sample", type=int, metavar="HZ", help="also sample every CPU's call chains at HZ (cpu-clock)")
    ap.add_argument("busy_args", nargs=argparse.REMAINDER, help="-- then benchmarks.busy's arguments")
    args = ap.parse_args(argv)
    busy_args = [a for a in args.busy_args if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or tmp
        os.makedirs(where, exist_ok=True)
        data, busy_json = os.path.join(where, "perf.data"), os.path.join(where, "busy.json")
        events = [e for pair in TRACEPOINTS.items() for e in pair]
        if args.sample:  # call chains of the samples only (frame pointers: the kernel's and the leaf are enough)
            events.append(f"cpu-clock/call-graph=fp,freq={args.sample}/")
        cmd = ["perf", "record", "-q", "-a", "-k", "CLOCK_MONOTONIC", "-m", "4M", "-o", data,
               *[x for e in events for x in ("-e", e)], "--",
               sys.executable, "-m", "benchmarks.busy", "--explain", "--json", busy_json, *busy_args]
        subprocess.run(cmd, check=True, timeout=3600)
        with open(busy_json) as f:
            rows = _rows(json.load(f))
        script = subprocess.Popen(["perf", "script", "-i", data, "--ns", "-F", "tid,cpu,time,event,trace,ip,sym,dso"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        spans = Spans.parse(script.stdout)
        script.wait(timeout=600)
    out = [split(r, spans) for r in rows]
    for r in out:
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["irq_by_kind_ms"].items())
        print(f"{r['cell']}: {r['task']} {r.get('from', '')}-{r.get('to', '')} {r['cpu_ms']:.2f} ms of CPU in "
              f"{r['wall_ms']:.2f} wall: interrupts {r['irq_ms']:.2f} ({kinds}), own {r['own_ms']:.2f}"
              + (f"; sampled {r['sampled']}" if "sampled" in r else ""))
    if not out:
        print("no slice or reference block over 1 ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
