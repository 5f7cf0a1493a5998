# The busy-scheduler benchmark of issue 27 (docs/performance.md, "Busy schedulers"):
# kvferry and raw Mooncake (each in separate processes and in one process), raw NIXL and, where
# .venv-sglang exists (make setup-sglang), SGLang's own Mooncake backend, each driven
# by a scheduler loop that is idle, busy, or busy with one more Python thread; short,
# 8k-token and 64-concurrent workloads. About 30 minutes on 2 cores; not part of `make bench`.
# BUSY_BENCH_ARGS=--explain: kvferry's ranks also explain their slices over 1 ms and run a
# reference thread (docs/threads.md); that thread costs kvferry's cells latency, so the
# latency tables run without it.
BUSY_BENCH_JSON ?= busy-bench.json
BUSY_BENCH_ARGS ?=

.PHONY: bench-busy
bench-busy: setup
	$(PY) -m benchmarks.busy --json $(BUSY_BENCH_JSON) $(BUSY_BENCH_ARGS)
