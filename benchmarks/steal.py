"""The hypervisor's steal while a benchmark cell runs: the time the host ran
something else on this VM's vCPUs (``/proc/stat``'s steal column, per CPU,
in 10 ms ticks). A thread on a stolen vCPU stands still, as the guest sees
it neither running nor waiting for a CPU, and a request behind it waits as
long: :class:`StealWatch` samples the column every ``interval_s`` so that a
slow request can be laid beside the steal of its own window.

Off Linux (no ``/proc/stat``) the watch records nothing.
"""

from __future__ import annotations

import os
import threading
import time

TICK_MS = 1e3 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 10.0


def read_steal(path: str = "/proc/stat") -> list[int]:
    """Each CPU's steal so far, in ticks (``cpu0``, ``cpu1``, ... in order)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                out.append(int(line.split()[8]))
    return out


class StealWatch:
    """Samples every CPU's steal every ``interval_s`` (wall clock,
    ``time.time``) from entering to leaving; keeps each sample that saw
    steal as ``(from, to, ms by CPU)``."""

    def __init__(self, interval_s: float = 0.01, path: str = "/proc/stat") -> None:
        self.interval_s, self.path = interval_s, path
        self.samples: list[tuple[float, float, list[float]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StealWatch:
        if os.path.exists(self.path):
            self._thread = threading.Thread(target=self._run, name="steal-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        before, t0 = read_steal(self.path), time.time()
        while not self._stop.wait(self.interval_s):
            now, t1 = read_steal(self.path), time.time()
            if now != before:
                self.samples.append((t0, t1, [(b - a) * TICK_MS for a, b in zip(before, now)]))
            before, t0 = now, t1

    def total_ms(self) -> float:
        """All CPUs' steal over the watch."""
        return sum(sum(ms) for _, _, ms in self.samples)

    def within(self, start: float, end: float) -> float:
        """The most steal one CPU saw in the samples that overlap ``[start, end]`` (ms):
        at most one sample's interval more than the window on each side."""
        by_cpu: list[float] = []
        for t0, t1, ms in self.samples:
            if t1 >= start and t0 <= end:
                by_cpu = [a + b for a, b in zip(by_cpu or [0.0] * len(ms), ms)]
        return max(by_cpu, default=0.0)
