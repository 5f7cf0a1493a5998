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

.PHONY: setup-sglang test-sglang bench-sglang

setup-sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml mk/sglang.mk | debian-libs
	@test -x $(SGLANG_PY) || python3.11 -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) --upgrade pip
	$(SGLANG_PIP) torch==$(TORCH_VERSION)
	$(SGLANG_PIP) numpy pyzmq msgpack requests aiohttp $(MOONCAKE_PKG)==$(MOONCAKE_VERSION)
	$(SGLANG_PIP) --no-deps sglang==$(SGLANG_VERSION)
	$(SGLANG_PIP) $(SGLANG_RUNTIME_DEPS) triton==3.9.0 apache-tvm-ffi==0.1.11
	$(SGLANG_PIP) pytest
	# kvferry itself, editable, so its sglang.srt.plugins entry point registers.
	$(SGLANG_PIP) --no-deps -e .
	PYTHONPATH=$(CURDIR):$(CURDIR)/tests/engines/sglang/stubs $(SGLANG_PY) -c "import sglang.srt.disaggregation.utils, transfer.adapters.sglang"
	@touch $(SGLANG_STAMP)

test-sglang: setup-sglang
	PYTHONPATH=$(CURDIR):$(CURDIR)/tests/engines/sglang/stubs timeout 900 $(SGLANG_PY) -m pytest -q -p no:cacheprovider tests/engines/sglang

bench-sglang: setup-sglang
	PYTHONPATH=$(CURDIR):$(CURDIR)/tests/engines/sglang/stubs timeout 1500 $(SGLANG_PY) -m benchmarks.sglang --out docs/sglang.md
