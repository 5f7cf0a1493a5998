"""A busy engine step in pure Python, for the benchmarks' busy schedulers
(``benchmarks.busy_loop`` and the workload loops' ``Spec.busy_step_s``).
Standard library only: the raw engines' rank processes import it too."""

from __future__ import annotations

import time


def python_work(seconds: float) -> None:
    """Pure-Python work for ``seconds``: it holds the interpreter lock but
    for the periodic switches, as an engine's scheduler step does."""
    until = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < until:
        for i in range(100):
            x += i * i
