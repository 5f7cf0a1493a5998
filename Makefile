# kvferry: set-up, demo and tests. Every target does its own set-up.
SHELL := /bin/bash
PYTHON ?= python3.11
# One virtual environment per Python: .venv for 3.11 (the default, used by CI),
# .venv-X.Y for another (`make test PYTHON=python3.12` builds .venv-3.12).
PY_VERSION := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
VENV := $(if $(filter 3.11,$(PY_VERSION)),.venv,.venv-$(PY_VERSION))
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
MOONCAKE_VERSION ?= 0.3.13.post1
NIXL_VERSION ?= 1.5.1
# On machines without CUDA the non-CUDA build of the engine; both install the
# same `mooncake` module, so an environment holds exactly one of them.
MOONCAKE_PKG ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo mooncake-transfer-engine || echo mooncake-transfer-engine-non-cuda)
STAMP := $(VENV)/.kvferry-setup

.PHONY: setup demo demo-load lint test test-long test-layouts test-scale test-engines scale bench clean debian-libs

setup: $(STAMP)

# The Mooncake engine needs libibverbs, librdmacm and libnuma at import time,
# even on machines without an RDMA NIC.
debian-libs:
	@if ! ldconfig -p | grep -q 'libibverbs.so.1' || ! ldconfig -p | grep -q 'librdmacm.so.1' || ! ldconfig -p | grep -q 'libnuma.so.1'; then \
		echo "installing libibverbs1 librdmacm1 libnuma1"; \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >/dev/null; \
	fi

$(STAMP): pyproject.toml Makefile | debian-libs
	@test -n "$(PY_VERSION)" || { echo "$(PYTHON) does not run here (installed, on PATH, enabled in pyenv?)"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check --upgrade pip
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	# (Where no CPU build of this version exists for the Python, pip takes PyPI's
	# CUDA build of it: about 4 GB, which still runs on the CPU.)
	$(PIP) install -q --disable-pip-version-check torch==$(TORCH_VERSION)
	$(PIP) install -q --disable-pip-version-check $(MOONCAKE_PKG)==$(MOONCAKE_VERSION)
	# The nixl:// storage backend (optional for users, tested here); after torch, so pip keeps it.
	$(PIP) install -q --disable-pip-version-check nixl-cu12==$(NIXL_VERSION)
	$(PIP) install -q --disable-pip-version-check -e '.[test]'
	$(PY) -c "import torch, zmq, msgpack, mooncake.engine" 
	@touch $(STAMP)

# The two-node example on one host: a tiny MLA target + GQA draft model pair,
# prefill TP 2 -> decode TP 1, tokens checked against a single-process run.
demo: setup
	$(PY) -m examples.two_node_demo

# Many requests of a Llama-8B-like layout, every byte checked.
demo-load: setup
	$(PY) -m examples.loopback_demo

# Two workers (pytest-xdist), each test's rank processes forked from a warm
# interpreter (harness/forkserver.py): about 7 minutes on two cores.
PYTEST_WORKERS := -n 2 --dist worksteal
# The library's suite; the benchmarks' smoke runs, the control-plane fuzzer's
# 3,000 bursts and the soak are `make test-long` (CI runs it next: together they
# outgrow `make test`'s ten minutes on two cores).
LONG_TESTS := tests/e2e/test_bench_smoke.py tests/e2e/test_bootstrap_load.py tests/e2e/test_fuzz.py \
	tests/e2e/test_soak.py
test: setup lint
	$(PY) -m pytest -q $(PYTEST_WORKERS) --ignore=tests/layouts $(addprefix --ignore=,$(LONG_TESTS))

# The benchmarks' smoke runs (each benchmark mode end to end, its JSON checked)
# and the fuzzer, then the soak alone: it checks that memory stays flat, and a
# neighbouring test's load moves its processes' high-water marks. About 3 minutes.
test-long: setup
	timeout 900 $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_WORKERS) tests/e2e/test_bench_smoke.py \
		tests/e2e/test_bootstrap_load.py tests/e2e/test_fuzz.py
	timeout 600 $(PY) -m pytest -q -p no:cacheprovider tests/e2e/test_soak.py

# pyflakes, bugbear and pyupgrade: unused names, undefined names, zips without strict=, old forms ([tool.ruff] in pyproject.toml).
lint: setup
	$(PY) -m ruff check --no-cache .

# vLLM's KV layouts (CPU, NHD, HND, cross-layer) and TP 2 <-> 1 through real
# processes and Mooncake, byte-exact (about 20 s; kept out of `make test`'s budget).
test-layouts: setup
	timeout 600 $(PY) -m pytest -q -p no:cacheprovider tests/layouts

# The scale test's small version (tests/scale, left out of `make test` for its
# budget): about 30 s on two cores. CI runs it after `make test`.
test-scale: setup
	timeout 600 $(PY) -m pytest -q -p no:cacheprovider tests/scale

# Thousands of rooms and 20 ranks in real processes, every byte checked; CPU,
# memory, threads and descriptors per role (JSON in scale.json). See docs/scale.md.
scale: setup
	$(PY) -m harness.scale --json scale.json

bench: setup
	$(PY) -m benchmarks
	$(PY) -m benchmarks --storage

# The serving engines' own environments and tests (mk/*.mk): real vLLM servers,
# and SGLang's own classes driving kvferry across processes. Never part of `make test`.
test-engines: test-sglang test-sglang-server test-vllm test-vllm-033

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# Optional fragments: mk/gpu.mk (make test-gpu), mk/sglang.mk (make test-sglang),
# mk/nixl.mk (make test-nixl: the multi-process suite on the NIXL transport).
-include mk/*.mk
