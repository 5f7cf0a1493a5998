"""What the machine did during a kvferry rank's long holds (benchmark only).

A periodic round's CPU time (:mod:`transfer.round_times`) bounds how long
it held the interpreter lock, but on this VM the bound also takes in what
the machine charged to the thread: the hypervisor's steal (the vCPU taken
away while the thread ran) and interrupts (no ``CONFIG_IRQ_TIME_ACCOUNTING``:
their time is charged to whichever thread they land on). :func:`install`
makes every round of the process's ranks read, at the start of each of its
slices, the machine's steal, softirq and irq ticks (``/proc/stat``, 10 ms
each) and the thread's ``getrusage``; a slice over :data:`LONG_S` is kept
with what advanced during it, so that a long hold says whether the machine
took time from it (:func:`long_slices`).

The reads cost about 15 us (more on a loaded machine) before each slice's
clocks start, so they are not counted in it, and the slice's wall-clock
span holds the whole slice.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time

#: A slice longer than this (CPU seconds) is kept.
LONG_S = 1e-3

_long: list[dict] = []
_lock = threading.Lock()


def machine_ticks() -> tuple[int, int, int]:
    """The machine's steal, softirq and irq ticks so far (all CPUs)."""
    with open("/proc/stat", "rb") as f:
        fields = f.readline().split()  # cpu user nice system idle iowait irq softirq steal
    return int(fields[8]), int(fields[7]), int(fields[6])


def ticks_since(before: tuple[int, int, int]) -> dict[str, int]:
    """The steal, softirq and irq ticks that advanced since ``before`` (:func:`machine_ticks`)."""
    return dict(zip(("steal", "softirq", "irq"), (b - a for a, b in zip(before, machine_ticks()))))


def _site(depth: int = 0) -> str:
    """Where the round's caller is (file:line), called from one of the
    round's methods (``depth`` frames more between them): a slice runs from
    one such site to the next."""
    frame = sys._getframe(2 + depth)  # _site <- the round's method <- its caller
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _mark(site: str) -> tuple:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return machine_ticks(), usage.ru_nvcsw, usage.ru_nivcsw, usage.ru_minflt, time.perf_counter(), site


def _what_advanced(task: str, cpu_s: float, mark: tuple, site: str) -> dict:
    advanced, usage, wall = ticks_since(mark[0]), resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
    return {"task": task, "cpu_ms": round(cpu_s * 1e3, 3), "wall_ms": round((wall - mark[4]) * 1e3, 3),
            # the thread and the slice's span on CLOCK_MONOTONIC (perf_counter's clock here): benchmarks.hold_trace
            "tid": threading.get_native_id(), "start_s": mark[4], "end_s": wall,
            **advanced, "voluntary": usage.ru_nvcsw - mark[1], "involuntary": usage.ru_nivcsw - mark[2],
            "minor_faults": usage.ru_minflt - mark[3], "from": mark[5], "to": site}


def install() -> None:
    """Every round this process's ranks start from now on is explained."""
    from transfer import round_times

    class _Explained(round_times._Round):
        """A round that marks the machine at each slice's start: before
        the slice's clocks start, so that its span on the wall clock
        (``start_s``, ``wall_ms``) holds the whole slice."""

        __slots__ = ("mark", "site")

        def _keep(self, ran: float, site: str) -> None:
            if ran > LONG_S:  # by the CPU clock alone (the round counts at most the wall time: held_ms)
                held = min(ran, self._wall() - self.start_wall)
                row = {**_what_advanced(self.task, ran, self.mark, site), "held_ms": round(held * 1e3, 3)}
                with _lock:
                    _long.append(row)

        def _begin(self) -> None:  # a slice starts: where (self.site, set by the caller) and the machine first
            self.mark = _mark(self.site)
            super()._begin()

        def __enter__(self):
            self.site = _site()
            return super().__enter__()

        def tick(self, ahead_s: float = 0.0) -> None:
            site, ran = _site(), self._own() - self.start
            if ran + ahead_s > round_times.SLICE_CPU_S:  # the slice ends here (read before its yield)
                self._keep(ran, site)
            self.site = site  # the next slice's start, if this tick cuts
            super().tick(ahead_s)

        @contextlib.contextmanager
        def waiting(self):
            site = _site(1)  # _site <- this generator <- contextlib's __enter__ <- the caller
            self._keep(self._own() - self.start, site)
            with super().waiting():
                try:
                    yield
                finally:
                    self.site = _site(1)  # where the next slice starts (the wait's end)

        def restart(self) -> None:
            self.site = _site()
            super().restart()

        def __exit__(self, *exc) -> None:
            self._keep(self._own() - self.start, _site())
            super().__exit__(*exc)

    round_times.RoundTimes.round = lambda self, task: _Explained(self, task)


class ReferenceHolds:
    """The control for the ranks' periodic rounds: a thread that runs the
    same ~0.1 ms of pure Python every 10 ms and keeps the longest CPU time it
    took, measured as a round is (``time.thread_time``). What it shows is the
    machine's, not kvferry's: this kernel charges interrupts to the thread
    they land on, and a vCPU can be taken away mid-block, each while the
    thread holds the interpreter lock. A periodic round that took longer
    than the reference's longest did work of its own.

    Around each block it reads the machine's steal, softirq and irq ticks
    (``/proc/stat``, 10 ms each): a block over 1 ms is kept with what
    advanced during it (``slow``), and the blocks under it count how often a
    tick advances anyway (``ticked``), the base rate to hold them against."""

    PERIOD_S = 0.01
    SLOW_S = 1e-3

    def __init__(self) -> None:
        self.max_s, self.blocks = 0.0, 0
        self.slow: list[dict] = []
        self.ticked = {"steal": 0, "softirq": 0, "irq": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reference-holds", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            before = machine_ticks()
            t0, start = time.perf_counter(), time.thread_time()
            x = 0
            for i in range(1500):  # about 0.1 ms
                x += i * i
            took, t1 = time.thread_time() - start, time.perf_counter()
            advanced = ticks_since(before)
            self.max_s = max(self.max_s, took)
            self.blocks += 1
            if took > self.SLOW_S:
                self.slow.append({"cpu_ms": round(took * 1e3, 2), "wall_ms": round((t1 - t0) * 1e3, 2), **advanced,
                                  "tid": threading.get_native_id(), "start_s": t0, "end_s": t1})
            else:
                for k, v in advanced.items():
                    self.ticked[k] += v > 0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


def long_slices() -> list[dict]:
    """The slices over :data:`LONG_S` so far, each with what advanced in it."""
    with _lock:
        return list(_long)
