# The multi-process suite on the NIXL transport (UCX on loopback): every rank of
# tests/e2e runs with EngineConfig.backend="nixl" (KVFERRY_TEST_TRANSPORT=nixl, read
# by harness.launch.child_env); tests that poke Mooncake's internals skip. `make test`
# keeps only tests/e2e/test_nixl.py's two small NIXL runs (its time budget). Tests marked
# transport_free (the bootstrap server's and the control channel's: no rank's transport
# starts) would run the same twice: left out.
.PHONY: test-nixl

test-nixl: setup
	KVFERRY_TEST_TRANSPORT=nixl $(PY) -m pytest -q $(PYTEST_WORKERS) -m 'not transport_free' tests/e2e --deselect tests/e2e/test_soak.py
	KVFERRY_TEST_TRANSPORT=nixl $(PY) -m pytest -q tests/e2e/test_soak.py
