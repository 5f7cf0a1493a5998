"""What the busy-scheduler benchmark shares between its rank processes: the
configuration, the pool geometry, each room's pages, the scheduler loop it
drives every system with (:class:`Scheduler`) and the pipe its requests
come from (:class:`Feed`).

A serving engine drives its transfer backend from a scheduler loop whose
thread is busy in Python for most of each step (SGLang's scheduler, vLLM's
model runner). The benchmark's loop runs one step every ``step_s``: idle, a
sleep; busy, ``busy_share`` of the step pure-Python work (the rest a sleep);
with ``extra_thread`` one more thread does pure-Python work all the time (a
tokenizer, a metrics exporter). Each step then polls the live rooms once.

Requests come as a serving engine's do, from outside: the driver
(:mod:`benchmarks.busy`) writes each request's room to every rank process's
stdin, at most ``concurrency`` at a time, the next once both sides reported
one done (``BUSY_DONE side room`` on stdout). A rank's loop takes what its
pipe holds without blocking, opens those rooms (decode: the receiver and
its pages; prefill: the sender), steps, and polls each live room once; so
nothing of a system's runs between steps but its own threads, as in
SGLang's scheduler and vLLM's ``get_finished``.

Every rank process of every system says it is ready with :func:`ready`,
which first freezes the heap it built while setting up, as vLLM's engine
core does after start-up (``freeze_gc_heap``): a collection then walks what
the run makes, not the start-up's imports, pools and engines.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from harness.busywork import python_work

#: The first request's room (the rest follow in order).
FIRST_ROOM = 1000


@dataclass(frozen=True)
class BusyConfig:
    """One cell of the benchmark: a workload run by one system in one
    scheduler mode. Geometry: ``layers`` x K/V buffers of pages of
    ``page_size`` tokens x ``heads`` x ``head_dim`` bf16 (32 KiB by default);
    a request is ``pages`` random pages of every buffer."""

    pages: int = 32
    requests: int = 120
    concurrency: int = 1
    warmup: int = 2
    layers: int = 8
    heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    step_s: float = 0.010
    busy_share: float = 0.0
    extra_thread: bool = False
    # kvferry's ranks explain their long slices (benchmarks.busy_explain) and run a
    # reference thread: a thread of the benchmark's own that wants the interpreter
    # lock every 10 ms, so latencies are not comparable with the other systems'
    explain: bool = False
    seed: int = 2027
    bootstrap: str = ""  # kvferry: the bootstrap server's address
    node_id: str = "busy-prefill"
    endpoint: str = ""  # raw engines: decode's control endpoint
    session: str = ""  # raw Mooncake: decode's engine session
    addr: int = 0  # raw Mooncake: decode's pool address

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.heads * self.head_dim * 2

    @property
    def num_buffers(self) -> int:
        return 2 * self.layers

    @property
    def request_bytes(self) -> int:
        return self.pages * self.page_bytes * self.num_buffers

    @property
    def prefill_pages(self) -> int:
        return max(4 * self.pages, 256)

    @property
    def decode_pages(self) -> int:
        return (self.concurrency + 1) * self.pages + 8

    @property
    def num_rooms(self) -> int:
        return self.warmup + self.requests

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> BusyConfig:
        return BusyConfig(**json.loads(text))


def src_pages(cfg: BusyConfig, room: int) -> np.ndarray:
    """A room's prefill pages: random, the same on every side."""
    return np.random.default_rng([cfg.seed, room]).permutation(cfg.prefill_pages)[:cfg.pages].astype(np.int64)


class DecodePages:
    """Decode's page allocator: random free pages per room."""

    def __init__(self, cfg: BusyConfig) -> None:
        self.free = [int(p) for p in np.random.default_rng([cfg.seed, 7]).permutation(cfg.decode_pages)]
        self.pages = cfg.pages

    def take(self) -> np.ndarray:
        out, self.free = self.free[:self.pages], self.free[self.pages:]
        return np.asarray(out, dtype=np.int64)

    def give(self, pages) -> None:
        self.free.extend(int(p) for p in pages)


class Scheduler:
    """The loop's step (see the module docstring)."""

    def __init__(self, cfg: BusyConfig) -> None:
        self.cfg = cfg
        self._stop = threading.Event()
        if cfg.extra_thread:
            threading.Thread(target=self._spin, name="busy-extra", daemon=True).start()

    def _spin(self) -> None:
        while not self._stop.is_set():
            python_work(0.001)

    def step(self) -> None:
        busy = self.cfg.busy_share * self.cfg.step_s
        if busy:
            python_work(busy)
        if self.cfg.step_s > busy:
            time.sleep(self.cfg.step_s - busy)

    def stop(self) -> None:
        self._stop.set()


class ThreadClock:
    """The calling thread's account, as the kernel keeps it: seconds on a
    CPU (``time.thread_time``) and seconds waiting on a run queue
    (``/proc/thread-self/schedstat``; with paravirtual steal accounting
    neither counts time the hypervisor stole from the vCPU), and its
    voluntary and involuntary context switches (``getrusage``). Read it on
    the thread it was made on. schedstat's own CPU figure is not used: it
    lags the running thread by up to a scheduler tick. Where the kernel has
    no schedstat, the queue reads 0."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> tuple[float, float, int, int]:
        """``(cpu_s, runq_s, voluntary, involuntary)`` so far."""
        ru = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
        runq = 0.0 if self._fd is None else int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        return time.thread_time(), runq, ru.ru_nvcsw, ru.ru_nivcsw

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SlowSteps:
    """The loop's slowest iterations, each with the ms of its parts (``take``
    the pipe, ``open`` the new rooms, ``step``, ``poll`` the live ones) and
    when it began (s into the loop): a room opened late behind a loop that
    stood still shows here with the part that stood.

    Given the thread's :class:`ThreadClock` before and after, an iteration
    also says where its time went: ``cpu`` (ms on a CPU), ``runq`` (ms
    waiting for one), ``unseen`` (the rest: asleep, as for the interpreter
    lock or I/O, or stolen by the hypervisor) and its ``voluntary`` and
    ``involuntary`` switches. ``unseen`` with no voluntary switch is time
    the thread never gave up yet did not run: the host took its vCPU."""

    KEEP = 5

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._rows: list[dict] = []

    def add(self, start: float, *parts: tuple[str, float], calls: dict[str, float] | None = None,
            clock: tuple[tuple, tuple] | None = None) -> None:
        """One iteration from ``start``: ``(name, end)`` for each part, in order (``time.perf_counter``);
        ``calls``: ms spent in the system's API calls inside them (``prefill_kv_send``, say);
        ``clock``: :meth:`ThreadClock.read` at ``start`` and at the end."""
        total = parts[-1][1] - start
        if len(self._rows) == self.KEEP and total <= self._rows[-1]["ms"] / 1e3:
            return
        row, begin = {"ms": round(total * 1e3, 2), "at_s": round(start - self._t0, 3)}, start
        for name, end in parts:
            row[name] = round((end - begin) * 1e3, 2)
            begin = end
        row.update({k: round(v, 2) for k, v in (calls or {}).items()})
        if clock is not None:
            (cpu0, q0, v0, i0), (cpu1, q1, v1, i1) = clock
            cpu, runq = (cpu1 - cpu0) * 1e3, (q1 - q0) * 1e3
            row.update(cpu=round(cpu, 2), runq=round(runq, 2), unseen=round(total * 1e3 - cpu - runq, 2),
                       voluntary=v1 - v0, involuntary=i1 - i0)
        self._rows = sorted([*self._rows, row], key=lambda r: -r["ms"])[:self.KEEP]

    def slowest(self) -> list[dict]:
        return list(self._rows)


def ready(payload: str = "{}") -> None:
    """Set-up done: collect and freeze the heap built so far (vLLM's engine
    core does the same after start-up), then say ``BUSY_READY payload``."""
    gc.collect()
    gc.freeze()
    print("BUSY_READY " + payload, flush=True)


def result_line(role: str, created: dict, done: dict, **extra) -> str:
    """What a rank prints: per room its creation and end times (wall clock,
    comparable between processes of one host)."""
    return "BUSY_RESULT " + json.dumps({"role": role, "created": created, "done": done, **extra})


class Feed:
    """The driver's requests: room numbers, one per line on this process's
    stdin, read without blocking (:meth:`take`, once a step); ``closed``
    once the driver closed the pipe (no more requests)."""

    def __init__(self) -> None:
        self._fd = sys.stdin.fileno()
        os.set_blocking(self._fd, False)
        self._buf = b""
        self.closed = False

    def take(self) -> list[int]:
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return []
        if not data:
            self.closed = True
            return []
        *lines, self._buf = (self._buf + data).split(b"\n")
        return [int(line) for line in lines if line.strip()]

    @staticmethod
    def done(side: str, room: int) -> None:
        """Tell the driver ``side`` (prefill, decode) ended ``room``."""
        sys.stdout.write(f"BUSY_DONE {side} {room}\n")
        sys.stdout.flush()
