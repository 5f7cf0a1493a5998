"""``python -m benchmarks.turns``: where a room's turns go.

Runs the busy benchmark's one-process cell (both managers and the scheduler
loop in this process, :mod:`benchmarks.busy_ranks`) with each manager's lock
replaced by a counting one, and reports per room, for each thread that took
a manager's lock: how often it took it, how long it held it, and how long it
waited for it (the interpreter lock included: a thread that wants the
manager's lock first needs the GIL), and each thread's CPU time (from
``/proc/self/task``). Run it idle and busy: the difference is where the
busy scheduler's GIL makes kvferry's threads wait.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from dataclasses import replace

from benchmarks.busy import MODES, WORKLOADS


LONG_HOLD_S = 0.002


def _site() -> str:
    """Where the lock is being taken: the first frames outside this module and threading."""
    frame, out = sys._getframe(2), []
    while frame is not None and len(out) < 3:
        name = frame.f_code.co_filename
        if not name.endswith(("turns.py", "threading.py")):
            out.append(f"{os.path.basename(name)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(out)


class CountingRLock:
    """An RLock that records, per thread name, outermost acquisitions, the
    time held and the time waited."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._lock = threading.RLock()
        self._local = threading.local()
        self.stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
        #: (thread, where it took the lock) -> seconds held, over holds longer than LONG_HOLD_S
        self.long_holds: dict[tuple[str, str], float] = collections.defaultdict(float)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t0 = time.perf_counter()
        ok = self._lock.acquire(blocking, timeout)
        if ok:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                now = time.perf_counter()
                self._local.since = now
                self._local.site = _site()
                s = self.stats[threading.current_thread().name]
                s[0] += 1
                s[2] += now - t0
            self._local.depth = depth + 1
        return ok

    def release(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            held = time.perf_counter() - self._local.since
            self.stats[threading.current_thread().name][1] += held
            if held > LONG_HOLD_S:
                self.long_holds[(threading.current_thread().name, self._local.site)] += held
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()

    # What threading.Condition needs of an RLock (wait() gives it up whole, then takes it back).
    def _is_owned(self) -> bool:
        return self._lock._is_owned()

    def _release_save(self):
        depth, self._local.depth = self._local.depth, 1
        self.release()
        return depth

    def _acquire_restore(self, depth) -> None:
        self.acquire()
        self._local.depth = depth


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = collections.defaultdict(float)
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[names.get(int(tid), "(engine / native)")] += (int(fields[11]) + int(fields[12])) / tick
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.turns", description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=list(MODES), default="busy")
    ap.add_argument("--workload", choices=list(WORKLOADS), default="short")
    ap.add_argument("--requests", type=int, default=40)
    args = ap.parse_args(argv)
    from harness.launch import BootstrapProcess
    import transfer.manager as manager_module
    from benchmarks import busy_ranks

    locks: list[CountingRLock] = []

    class _Threading:  # the manager module's view of threading: its RLock counts
        def __getattr__(self, name):
            return getattr(threading, name)

        @staticmethod
        def RLock():
            locks.append(CountingRLock(("prefill", "decode")[len(locks) % 2]))
            return locks[-1]

    manager_module.threading = _Threading()
    snapshot: dict[str, float] = {}
    close = manager_module.KVManager.close

    def close_after_snapshot(mgr) -> None:  # the threads' CPU before the first manager's threads end
        if not snapshot:
            snapshot.update(_thread_cpu())
        close(mgr)

    manager_module.KVManager.close = close_after_snapshot
    cfg = replace(WORKLOADS[args.workload], requests=args.requests, **MODES[args.mode])
    with BootstrapProcess() as server:
        cfg = replace(cfg, bootstrap=server.address)
        cpu0, t0 = _thread_cpu(), time.monotonic()
        busy_ranks.run_kvferry(cfg, "kvferry-both")
        wall, cpu1 = time.monotonic() - t0, snapshot
    rooms = cfg.num_rooms
    print(f"{args.workload}, {args.mode}: {rooms} rooms in {wall:.2f} s; per room:")
    print(f"{'manager':8} {'thread':28} {'lock takes':>10} {'held ms':>8} {'waited ms':>9}")
    for lock in locks:
        for name, (n, held, waited) in sorted(lock.stats.items(), key=lambda kv: -kv[1][0]):
            print(f"{lock.label:8} {name:28} {n / rooms:10.1f} {held / rooms * 1e3:8.2f} {waited / rooms * 1e3:9.2f}")
    print(f"long holds (over {LONG_HOLD_S * 1e3:g} ms), ms per room:")
    for lock in locks:
        for (name, site), held in sorted(lock.long_holds.items(), key=lambda kv: -kv[1])[:6]:
            print(f"  {lock.label:8} {name:20} {held / rooms * 1e3:7.2f}  {site}")
    print(f"{'thread':37} {'CPU ms':>8}")
    for name in sorted(cpu1, key=lambda n: -(cpu1[n] - cpu0.get(n, 0.0))):
        used = cpu1[name] - cpu0.get(name, 0.0)
        if used > 0:
            print(f"{name:37} {used / rooms * 1e3:8.2f}")
    return 0


if __name__ == "__main__":
    code = main()
    os._exit(code)
