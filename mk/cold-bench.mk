# The cold-start benchmark of issue 39 (docs/performance.md, "Cold starts"): fresh prefill ->
# decode process pairs with neighbours on decode's Mooncake handshake port, then one pair
# streaming while other decode ranks join its prefill rank. About 5 minutes on 2 cores.
.PHONY: bench-cold
bench-cold: setup
	$(PY) -m benchmarks.cold_start --pairs 15 --json cold-start.json
	$(PY) -m benchmarks.cold_start --streaming --events 30 --json cold-start-streaming.json
