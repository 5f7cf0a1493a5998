# The multi-process suite on the NIXL transport (UCX on loopback): every rank of
# tests/e2e runs with EngineConfig.backend="nixl" (KVFERRY_TEST_TRANSPORT=nixl, read
# by harness.launch.child_env); tests that poke Mooncake's internals skip. `make test`
# keeps only tests/e2e/test_nixl.py's two small NIXL runs (its time budget).
.PHONY: test-nixl

test-nixl: setup
	KVFERRY_TEST_TRANSPORT=nixl $(PY) -m pytest -q $(PYTEST_WORKERS) tests/e2e --deselect tests/e2e/test_soak.py
	KVFERRY_TEST_TRANSPORT=nixl $(PY) -m pytest -q tests/e2e/test_soak.py
