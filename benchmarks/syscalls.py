"""``python -m benchmarks.syscalls``: where the time goes over TCP, by syscall.

For each mode (``kvferry``, raw ``mooncake``, the plain TCP stream of
``limit``; ``kvferry-nixl`` and raw ``nixl`` with ``UCX_TLS=tcp``) it runs
``python -m benchmarks --only WORKLOAD --modes MODE --rounds 1`` and attaches
``strace -f -tt -yy`` to the processes that move the bytes for a window
while they run. From the trace it counts, in the interval where bytes flowed
over TCP sockets: socket calls and their bytes (return values) by direction,
and every other syscall by name, per GB moved.

strace stops a thread at every syscall, so the traced run is slower than
the benchmark's and a receiver finds more bytes waiting per call than it
would untraced; calls per GB are therefore a lower bound for receive sides,
exact for senders that write whole buffers. Compare modes within one run.
Needs ``strace`` (Debian's package) and ptrace rights (root, or
``kernel.yama.ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

# Which processes move a mode's bytes: (role, cmdline fragment); "SELF" is the benchmark process.
TARGETS = {
    "kvferry": [("prefill", "--role prefill"), ("decode", "--role decode")],
    "kvferry-nixl": [("prefill", "--role prefill"), ("decode", "--role decode")],
    "mooncake": [("sender", "mc-send"), ("receiver", "mc-recv")],
    "nixl": [("sender", "nixl-send"), ("receiver", "nixl-recv")],
    "limit": [("sender", "SELF"), ("receiver", "sock-recv")],
}
SEND = {"sendmsg", "sendto", "write", "writev", "sendmmsg", "pwritev", "pwritev2"}
RECV = {"recvmsg", "recvfrom", "read", "readv", "recvmmsg", "preadv", "preadv2"}
_LINE = re.compile(r"^(?:\[pid\s+)?(\d+)\]?\s*(\d\d):(\d\d):(\d\d\.\d+) (\w+)\((.*)$")
_RESULT = re.compile(r"= (-?\d+)")
_UNFINISHED = re.compile(r"^(?:\[pid\s+)?(\d+)\]?\s*[\d:.]+ <\.\.\. (\w+) resumed>(.*)$")
BIG_CALL = 64 << 10  # a socket call of at least this many bytes marks the data phase


def _on_tcp(text: str) -> bool:
    """Whether a call's arguments (strace ``-yy``) name a TCP socket."""
    return "TCP:[" in text or "TCPv6:[" in text


@dataclass
class Side:
    role: str
    calls: Counter = field(default_factory=Counter)
    sock_calls: Counter = field(default_factory=Counter)
    sock_bytes: Counter = field(default_factory=Counter)
    threads: set = field(default_factory=set)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parse(path: str, role: str) -> tuple[Side, float, float]:
    """One trace: the calls in the data phase (first to last big socket call)."""
    events = []  # (t, tid, name, is_socket, result)
    pending = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = _LINE.match(line)
            if m:
                tid, h, mi, s, name, rest = m.groups()
                t = int(h) * 3600 + int(mi) * 60 + float(s)
                if rest.endswith("<unfinished ...>"):
                    pending[tid] = (t, name, _on_tcp(rest))
                    continue
                r = _RESULT.search(rest.rsplit(")", 1)[-1] if ")" in rest else rest)
                events.append((t, tid, name, _on_tcp(rest), int(r.group(1)) if r else 0))
                continue
            m = _UNFINISHED.match(line)
            if m and m.group(1) in pending:
                t, name, sock = pending.pop(m.group(1))
                r = _RESULT.search(m.group(3))
                events.append((t, m.group(1), name, sock or _on_tcp(m.group(3)), int(r.group(1)) if r else 0))
    big = [e[0] for e in events if e[3] and e[2] in SEND | RECV and e[4] >= BIG_CALL]
    side = Side(role)
    if not big:
        return side, 0.0, 0.0
    t0, t1 = min(big), max(big)
    for t, tid, name, sock, res in events:
        if not t0 <= t <= t1:
            continue
        side.calls[name] += 1
        side.threads.add(tid)
        if sock and name in SEND | RECV:
            way = "send" if name in SEND else "recv"
            side.sock_calls[way] += 1
            side.sock_bytes[way] += max(res, 0)
    return side, t0, t1


def run_mode(mode: str, workload: str, requests: int, window_s: float, delay_s: float, ucx_tls: str,
             workdir: str) -> dict:
    out_json = os.path.join(workdir, f"{mode}.json")
    argv = [sys.executable, "-m", "benchmarks", "--only", workload, "--modes", mode, "--rounds", "1",
            "--requests", str(requests), "--json", out_json, "--ucx-tls", ucx_tls]
    bench = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    found: dict[str, int] = {}
    deadline = time.monotonic() + 300
    while len(found) < len(TARGETS[mode]) and bench.poll() is None and time.monotonic() < deadline:
        kids = {p: _cmdline(p) for p in _descendants(bench.pid)}
        for role, frag in TARGETS[mode]:
            if role in found:
                continue
            if frag == "SELF":
                if any("sock-recv" in c for c in kids.values()):
                    found[role] = bench.pid
            else:
                hit = [p for p, c in kids.items() if frag in c and "strace" not in c]
                if hit:
                    found[role] = min(hit)
        time.sleep(0.05)
    time.sleep(delay_s if mode != "limit" else min(delay_s, 0.3))  # past start-up (the stream has none)
    tracers = []
    for role, pid in found.items():
        path = os.path.join(workdir, f"{mode}-{role}.trace")
        tracers.append((role, path, subprocess.Popen(
            ["timeout", "-s", "INT", str(window_s), "strace", "-f", "-tt", "-yy", "-qq", "-o", path, "-p", str(pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    for _, _, t in tracers:
        t.wait()
    bench.wait(timeout=1800)
    sides = {}
    for role, path, _ in tracers:
        side, t0, t1 = _parse(path, role)
        moved = max(side.sock_bytes.values(), default=0)
        gb = moved / 1e9
        per_gb = lambda n: round(n / gb, 1) if gb else None  # noqa: E731
        sides[role] = {
            "data_phase_s": round(t1 - t0, 3), "tcp_bytes": dict(side.sock_bytes), "threads": len(side.threads),
            "socket_calls_per_gb": {k: per_gb(v) for k, v in side.sock_calls.items()},
            "bytes_per_socket_call": {k: round(side.sock_bytes[k] / v) for k, v in side.sock_calls.items() if v},
            "top_calls_per_gb": {k: per_gb(v) for k, v in side.calls.most_common(8)},
        }
        os.unlink(path)
    rows = []
    if os.path.exists(out_json):
        with open(out_json) as f:
            rows = json.load(f).get("rows", [])
    return {"mode": mode, "workload": workload, "processes": {r: p for r, p in found.items()}, "sides": sides,
            "untraced_rows": [{k: r.get(k) for k in ("mode", "transport", "ucx_tls", "baseline", "gbps")}
                              for r in rows]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.syscalls", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="mha-8k-contig")
    ap.add_argument("--modes", default="kvferry,mooncake,limit")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--window-s", type=float, default=4.0, help="how long strace stays attached")
    ap.add_argument("--delay-s", type=float, default=4.0, help="wait this long after the processes appear")
    ap.add_argument("--ucx-tls", default="tcp")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if shutil.which("strace") is None:
        print("strace is not installed (Debian: apt-get install strace)", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="kvferry-syscalls-") as workdir:
        for mode in args.modes.split(","):
            res = run_mode(mode, args.workload, args.requests, args.window_s, args.delay_s, args.ucx_tls, workdir)
            results.append(res)
            for role, s in res["sides"].items():
                print(f"{mode:13} {role:9} threads {s['threads']:3}  TCP bytes {s['tcp_bytes']}  "
                      f"socket calls/GB {s['socket_calls_per_gb']}  bytes/call {s['bytes_per_socket_call']}")
                print(f"{'':23} top calls/GB {s['top_calls_per_gb']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
