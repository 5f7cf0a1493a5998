"""``python -m benchmarks.transport_rounds JOBS DESCRIPTORS BYTES``: what the
Mooncake transport's completion tracking costs. Two transports in one process
(TCP loopback), JOBS plans of DESCRIPTORS writes of BYTES each submitted at
once (a warm-up pass first); prints status checks per round and per
descriptor (``MooncakeTransport.num_status_checks`` / ``num_rounds``), CPU
per descriptor, and checks the bytes landed. See docs/scale.md."""

import json
import os
import sys
import time

import numpy as np

from transfer.config import EngineConfig
from transfer.plan import TransferPlan
from transfer.transport.mooncake.transport import MooncakeTransport


def main(argv: list[str]) -> None:
    num_jobs, desc_per_job, desc_bytes = (int(x) for x in argv)
    cfg = EngineConfig(protocol="tcp", log_level="ERROR")
    a, b = MooncakeTransport(cfg), MooncakeTransport(cfg)
    n = num_jobs * desc_per_job
    size = n * desc_bytes
    src = np.random.default_rng(0).integers(0, 256, size, np.uint8)
    dst = np.zeros(size, np.uint8)
    b.register([(dst.ctypes.data, size)])
    a.register([(src.ctypes.data, size)])
    done = []

    def plan(j: int) -> TransferPlan:
        off = np.arange(j * desc_per_job, (j + 1) * desc_per_job, dtype=np.uint64) * desc_bytes
        return TransferPlan(src.ctypes.data + off, dst.ctypes.data + off,
                            np.full(desc_per_job, desc_bytes, np.uint64))

    for _ in range(2):  # a warm-up pass, then the measured one
        done.clear()
        dst[:] = 0
        r0, c0, cpu0, t0 = a.num_rounds, a.num_status_checks, time.process_time(), time.monotonic()
        for j in range(num_jobs):
            a.submit(b.session, plan(j), done.append, None)
        deadline = time.monotonic() + 60
        while len(done) < num_jobs and time.monotonic() < deadline:
            time.sleep(0.001)
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        rounds, checks = a.num_rounds - r0, a.num_status_checks - c0
    ok = len(done) == num_jobs and all(e is None for e in done) and np.array_equal(src, dst)
    print(json.dumps(dict(ok=ok, jobs=num_jobs, descriptors=n, desc_bytes=desc_bytes, wall_s=round(wall, 3),
                          cpu_s=round(cpu, 3), rounds=rounds, checks=checks,
                          checks_per_round=round(checks / max(rounds, 1), 1),
                          checks_per_descriptor=round(checks / n, 2), cpu_us_per_descriptor=round(cpu / n * 1e6, 1))))
    a.close()
    b.close()
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # skip the engines' slow destructors


if __name__ == "__main__":
    main(sys.argv[1:] or ["64", "8", "16384"])
