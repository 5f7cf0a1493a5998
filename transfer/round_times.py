"""How long each round of a rank's periodic work held the interpreter lock:
the CPU time of its rounds, by task, for :class:`~transfer.stats.ManagerStats`
(``periodic_rounds``, ``periodic_max_cpu_s`` and the longest of each kind of
hold: :data:`HOLD_KINDS`) and docs/threads.md. Pure."""

from __future__ import annotations

import _thread
import contextlib
import gc
import resource
import threading
import time
from collections.abc import Iterator

#: The rank's periodic tasks, as :class:`RoundTimes` names them, and ``gc``:
#: the longest garbage collection that ran inside one of their rounds.
PERIODIC_TASKS = ("liveness", "sweep", "register", "resolver", "control", "metrics", "gc")

#: What the thread's context switches (``getrusage``) say of a hold: ``whole``, none (the thread was on a CPU
#: from its start to its end, so its CPU time, capped at the wall time, is exact); ``preempted``, only
#: involuntary ones (the OS took the CPU: the thread's clock gains at each return, so the figure is an upper
#: bound); ``waited``, a voluntary one (a wait not cut by ``waiting()``, in a call that let the interpreter lock
#: go: several holds counted as one, an upper bound).
HOLD_KINDS = ("whole", "preempted", "waited")

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux


class _GcClock:
    """The CPU time each thread spent in the interpreter's garbage
    collections (``gc.callbacks``), so that a round counts its own work: a
    collection runs in whichever thread allocated past the threshold, and
    walks the whole process's objects, not the round's."""

    def __init__(self) -> None:
        self._local = threading.local()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        local = self._local
        now, wall = time.thread_time(), time.perf_counter()
        if phase == "start":
            local.start, local.start_wall = now, wall
            return
        pause = now - getattr(local, "start", now)
        local.spent = getattr(local, "spent", 0.0) + pause
        local.spent_wall = getattr(local, "spent_wall", 0.0) + wall - getattr(local, "start_wall", wall)
        local.longest = max(getattr(local, "longest", 0.0), pause)

    def spent(self) -> float:
        """This thread's CPU seconds in collections so far."""
        return getattr(self._local, "spent", 0.0)

    def spent_wall(self) -> float:
        """The wall-clock seconds this thread's collections lasted so far."""
        return getattr(self._local, "spent_wall", 0.0)

    def take_longest(self) -> float:
        """This thread's longest collection since the last call."""
        longest, self._local.longest = getattr(self._local, "longest", 0.0), 0.0
        return longest


_gc_clock: _GcClock | None = None
_gc_lock = threading.Lock()


def _clock() -> _GcClock:
    """The process's one :class:`_GcClock`, installed by the first RoundTimes."""
    global _gc_clock
    with _gc_lock:
        if _gc_clock is None:
            _gc_clock = _GcClock()
        return _gc_clock


class RoundTimes:
    """The CPU time of each round of a rank's periodic work, by task
    (:data:`PERIODIC_TASKS`): ``liveness`` (a heartbeat round), ``sweep``
    (every live room polled for its timeouts), ``register`` (a
    re-registration), ``resolver`` (a round of the link resolver),
    ``control`` (the channel thread's idle wake-up), ``metrics`` (a
    ``/metrics`` scrape, on the HTTP server's thread). A round's time is the
    work it did holding the interpreter lock: its thread's CPU time, and
    never more than the wall-clock time that passed (a thread cannot run
    longer than that; on a VM its CPU clock can: docs/threads.md measured it
    4.6 ms ahead in 0.08 ms). A garbage collection that ran
    inside a round is not the round's (it walks the process's objects, and
    runs in whichever thread allocated past the threshold): it is taken out
    of the round's time and counted apart, as ``gc``, the longest such
    collection. Each round is also counted by its kind
    (:data:`HOLD_KINDS`, from the thread's context switches inside it).
    Each task's thread writes its own entries (its own lock, not
    the rank's: the measure takes none of what ``poll()`` needs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rounds: dict[str, int] = {}
        self.max_cpu_s: dict[str, float] = {}
        self.max_by_kind: dict[str, dict[str, float]] = {kind: {} for kind in HOLD_KINDS}
        self.gc = _clock()

    def round(self, task: str) -> _Round:
        """``with times.round("liveness"): ...`` measures one round. A round
        over many items (the sweep over every live room) calls ``tick()``
        between two (``with times.round("sweep") as r:``): once the round ran
        :data:`SLICE_CPU_S` it gives the interpreter lock up, and each such
        slice counts as a round."""
        return _Round(self, task)

    def add(self, task: str, cpu_s: float, kind: str | None = None) -> None:
        """One round (a hold) of ``task``; ``kind``: one of :data:`HOLD_KINDS`, or None (not known)."""
        with self._lock:
            self.rounds[task] = self.rounds.get(task, 0) + 1
            if cpu_s > self.max_cpu_s.get(task, 0.0):
                self.max_cpu_s[task] = cpu_s
            if kind is not None and cpu_s > self.max_by_kind[kind].get(task, 0.0):
                self.max_by_kind[kind][task] = cpu_s

    def snapshot(self) -> dict:
        """The :class:`ManagerStats` fields."""
        with self._lock:
            return {"periodic_rounds": dict(self.rounds), "periodic_max_cpu_s": dict(self.max_cpu_s),
                    "periodic_max_by_kind_s": {kind: dict(m) for kind, m in self.max_by_kind.items()}}


#: A round that ticks gives the interpreter lock up after this much CPU: a hold is at most this and the
#: longest part between two ticks, under a millisecond (a part known to be long, a new peer's socket,
#: gets a slice of its own: ``tick(ahead_s)``).
SLICE_CPU_S = 0.0003


#: The round this thread is in (``round``), if any: :class:`RoundLock` cuts it at a wait.
_current = threading.local()


class RoundLock(_thread.RLock):
    """A re-entrant lock (the rank's: ``with``, ``acquire``, a
    ``threading.Condition`` over it) that a periodic round waits for as it
    waits for anything else: inside the round's ``waiting()``, so the holds
    on either side are measured apart (the interpreter lock is released
    while it waits). Uncontended, it is taken at once, as an ``RLock``."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if super().acquire(False):
            return True
        if not blocking:
            return False
        round_ = getattr(_current, "round", None)
        if round_ is None:
            return super().acquire(True, timeout)
        with round_.waiting():
            return super().acquire(True, timeout)

    __enter__ = acquire


class _Round:
    __slots__ = ("times", "task", "start", "start_wall", "start_switches", "outer")

    def __init__(self, times: RoundTimes, task: str) -> None:
        self.times, self.task = times, task

    def _own(self) -> float:
        """This thread's CPU seconds so far, its garbage collections left out."""
        return time.thread_time() - self.times.gc.spent()

    def _wall(self) -> float:
        """The wall clock (seconds), this thread's garbage collections left out."""
        return time.perf_counter() - self.times.gc.spent_wall()

    @staticmethod
    def _switches() -> tuple[int, int] | None:
        """This thread's voluntary and involuntary context switches so far (None where the OS cannot tell)."""
        if _RUSAGE_THREAD is None:
            return None
        usage = resource.getrusage(_RUSAGE_THREAD)
        return usage.ru_nvcsw, usage.ru_nivcsw

    def _begin(self) -> None:
        """A hold starts now."""
        self.start, self.start_wall, self.start_switches = self._own(), self._wall(), self._switches()

    def _count(self, held: float) -> None:
        """The hold since :meth:`_begin`, ``held`` seconds, counted as a round, with its kind."""
        kind, now = None, self._switches()
        if now is not None and self.start_switches is not None:
            voluntary, involuntary = now[0] - self.start_switches[0], now[1] - self.start_switches[1]
            kind = "waited" if voluntary else "preempted" if involuntary else "whole"
        self.times.add(self.task, held, kind)

    def _held(self) -> float:
        """The hold so far: CPU seconds since :meth:`_begin`, at most the wall-clock seconds."""
        return min(self._own() - self.start, self._wall() - self.start_wall)

    def __enter__(self) -> _Round:
        self.times.gc.take_longest()
        self.outer, _current.round = getattr(_current, "round", None), self
        self._begin()
        return self

    def tick(self, ahead_s: float = 0.0) -> None:
        """Between two parts of the round: gives the interpreter lock up
        once the slice ran :data:`SLICE_CPU_S`, or would with the
        ``ahead_s`` of CPU the next part is known to take (a part that
        takes most of a slice gets one of its own)."""
        ran = self._held()
        if ran + ahead_s > SLICE_CPU_S:
            self._count(ran)
            time.sleep(0)  # lets a waiting thread (the scheduler) take the interpreter lock
            self._begin()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """``with round_.waiting(): ...`` around a wait inside the round (the
        interpreter lock is given up there): what ran before it was one hold,
        counted as a round if it passed :data:`SLICE_CPU_S`, and the next hold
        is measured from the wait's return. The thread's CPU clock inside the
        wait is no hold: this kernel charges the interrupts and network work
        it serves while the thread is on a CPU, waking or taking the
        interpreter lock back, to the thread's clock (milliseconds a wait
        under load: docs/threads.md). A wait must not add the holds on
        either side."""
        ran = self._held()
        if ran > SLICE_CPU_S:
            self._count(ran)
        try:
            yield
        finally:
            self._begin()

    def restart(self) -> None:
        """Count the round from now (what ran before was not this task's)."""
        self._begin()

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """``with round_.aside(): ...`` around work that is not the round's
        (the control thread handling the messages that arrived): a wait for
        a :class:`RoundLock` inside it does not cut the round, so none of it
        is counted as the round's hold. The caller then calls
        :meth:`restart` where the work ran."""
        _current.round = self.outer
        try:
            yield
        finally:
            _current.round = self

    def __exit__(self, *exc) -> None:
        _current.round = self.outer
        self._count(self._held())
        collected = self.times.gc.take_longest()
        if collected:
            self.times.add("gc", collected)
