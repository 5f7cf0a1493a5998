# The NIXL comparison of issue 18 (docs/performance.md, "NIXL beside Mooncake"):
# kvferry on Mooncake and on NIXL, raw Mooncake, raw NIXL (UCX's defaults and
# UCX_TLS=tcp) and the link's limits, 3 alternating rounds, on the targets'
# workloads. About 15-25 minutes on 2 cores; not part of `make bench`.
NIXL_BENCH_JSON ?= nixl-bench.json

.PHONY: bench-nixl
bench-nixl: setup
	$(PY) -m benchmarks --only mha-128,mha-8k-contig,mha-8k-scatter,mha-128-c64 \
		--modes kvferry,kvferry-nixl,mooncake,nixl,limit --ucx-tls default,tcp --limits-each-round --json $(NIXL_BENCH_JSON)
