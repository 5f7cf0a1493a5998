"""What the real-server benchmarks (:mod:`benchmarks.vllm`,
:mod:`benchmarks.sglang_router`) share: the rounds over their list of
configurations, the nearest-rank percentile and the rewrite of a doc block."""

from __future__ import annotations

import os


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0..1) of ``values``."""
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run_rounds(prog: str, key: str, names: list[str], rounds: int, run_one) -> list[dict]:
    """``run_one(name)`` for each name, the list ``rounds`` times in turn, each
    run stamped with its round and the 1-minute load at its start and end.
    One name's failure is a result (``{key: name, "error": ...}``), not the
    end of the run."""
    runs = []
    for rnd in range(1, rounds + 1):
        for name in names:
            print(f"{prog}: round {rnd}: {name} ...", flush=True)
            load = os.getloadavg()[0]
            try:
                run = run_one(name)
            except Exception as exc:
                print(f"{prog}: {name} failed: {exc}", flush=True)
                run = {key: name, "error": str(exc)[:2000]}
            run.update({"round": rnd, "load_1m": [round(load, 1), round(os.getloadavg()[0], 1)]})
            runs.append(run)
    return runs


def rewrite_block(path: str, block: str, text: str) -> None:
    """Replace what stands between ``<!-- block -->`` and ``<!-- /block -->`` in ``path`` with ``text``."""
    with open(path) as f:
        doc = f.read()
    mark = f"<!-- {block} -->"
    start, end = doc.index(mark) + len(mark), doc.index(f"<!-- /{block} -->")
    with open(path, "w") as f:
        f.write(doc[:start] + "\n" + text + doc[end:])
