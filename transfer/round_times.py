"""How long each round of a rank's periodic work held the interpreter lock:
the CPU time of its rounds, by task, for :class:`~transfer.stats.ManagerStats`
(``periodic_rounds``, ``periodic_max_cpu_s``) and docs/threads.md. Pure."""

from __future__ import annotations

import threading
import time

#: The rank's periodic tasks, as :class:`RoundTimes` names them.
PERIODIC_TASKS = ("liveness", "sweep", "register", "resolver", "control")


class RoundTimes:
    """The CPU time of each round of a rank's periodic work, by task
    (:data:`PERIODIC_TASKS`): ``liveness`` (a heartbeat round), ``sweep``
    (every live room polled for its timeouts), ``register`` (a
    re-registration), ``resolver`` (a round of the link resolver),
    ``control`` (the channel thread's idle wake-up). A thread holds the
    interpreter lock only while it runs, so a round's CPU time bounds how
    long it kept the lock from the scheduler. Each task's thread writes its
    own entries (its own lock, not the rank's: the measure takes none of
    what ``poll()`` needs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rounds: dict[str, int] = {}
        self.max_cpu_s: dict[str, float] = {}

    def round(self, task: str) -> _Round:
        """``with times.round("liveness"): ...`` measures one round. A round
        over many items (the sweep over every live room) calls ``tick()``
        between two (``with times.round("sweep") as r:``): once the round ran
        :data:`SLICE_CPU_S` it gives the interpreter lock up, and each such
        slice counts as a round."""
        return _Round(self, task)

    def add(self, task: str, cpu_s: float) -> None:
        with self._lock:
            self.rounds[task] = self.rounds.get(task, 0) + 1
            if cpu_s > self.max_cpu_s.get(task, 0.0):
                self.max_cpu_s[task] = cpu_s

    def snapshot(self) -> dict:
        """The :class:`ManagerStats` fields."""
        with self._lock:
            return {"periodic_rounds": dict(self.rounds), "periodic_max_cpu_s": dict(self.max_cpu_s)}


#: A round that ticks gives the interpreter lock up after this much CPU (its holds stay under a millisecond).
SLICE_CPU_S = 0.0005


class _Round:
    __slots__ = ("times", "task", "start")

    def __init__(self, times: RoundTimes, task: str) -> None:
        self.times, self.task = times, task

    def __enter__(self) -> _Round:
        self.start = time.thread_time()
        return self

    def tick(self) -> None:
        ran = time.thread_time() - self.start
        if ran > SLICE_CPU_S:
            self.times.add(self.task, ran)
            time.sleep(0)  # lets a waiting thread (the scheduler) take the interpreter lock
            self.start = time.thread_time()

    def restart(self) -> None:
        """Count the round from now (what ran before was not this task's)."""
        self.start = time.thread_time()

    def __exit__(self, *exc) -> None:
        self.times.add(self.task, time.thread_time() - self.start)
