# The busy-scheduler benchmark of issue 27 (docs/performance.md, "Busy schedulers"):
# kvferry (separate processes and one process), raw Mooncake, raw NIXL and, where
# .venv-sglang exists (make setup-sglang), SGLang's own Mooncake backend, each driven
# by a scheduler loop that is idle, busy, or busy with one more Python thread; short,
# 8k-token and 64-concurrent workloads. About 30 minutes on 2 cores; not part of `make bench`.
BUSY_BENCH_JSON ?= busy-bench.json

.PHONY: bench-busy
bench-busy: setup
	$(PY) -m benchmarks.busy --json $(BUSY_BENCH_JSON)
