# make test-gpu: the GPU suite (tests/gpu/) in its own environment, .venv-gpu/.
# Included by the Makefile (`-include mk/*.mk`); see docs/gpu.md.
#
# On a machine where nvidia-smi lists a GPU: a venv with a CUDA torch that
# matches the driver's CUDA major version, the CUDA build of the Mooncake
# engine for it, and NIXL; then tests/gpu with it. Elsewhere: no install, the
# suite runs with the normal venv and skips every test with its reason.

GPU_PYTHON ?= $(PYTHON)
GPU_PY_VERSION := $(shell $(GPU_PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
GPU_VENV := .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
GPU_PIP := $(GPU_VENV)/bin/pip
GPU_STAMP := $(GPU_VENV)/.kvferry-gpu-setup
# The CUDA major version the driver supports ("CUDA Version: 12.8" in
# nvidia-smi's banner), empty where nvidia-smi is missing or lists no GPU.
GPU_CUDA ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1)
GPU_TORCH_VERSION ?= $(TORCH_VERSION)
# PyPI's torch 2.13.0 is a CUDA 13.0 build (it pulls cuda-toolkit 13.0); a CUDA 12
# driver needs PyTorch's cu128 index (that this index has 2.13.0 is unverified:
# override GPU_TORCH_INDEX_12, or GPU_TORCH_VERSION, if pip finds none).
GPU_TORCH_INDEX_13 ?= https://pypi.org/simple
GPU_TORCH_INDEX_12 ?= https://download.pytorch.org/whl/cu128
GPU_TORCH_INDEX := $(if $(filter 12,$(GPU_CUDA)),$(GPU_TORCH_INDEX_12),$(GPU_TORCH_INDEX_13))
# The CUDA builds of the Mooncake engine (pinned to the newest of each on PyPI):
# mooncake-transfer-engine is CUDA 12 (it needs libcudart.so.12);
# mooncake-transfer-engine-cuda13 is CUDA 13.
GPU_MOONCAKE_PKG := $(if $(filter 12,$(GPU_CUDA)),mooncake-transfer-engine==0.3.13.post1,mooncake-transfer-engine-cuda13==0.3.14)
GPU_NIXL_PKG := $(if $(filter 12,$(GPU_CUDA)),nixl-cu12,nixl-cu13)==$(NIXL_VERSION)
# pip must not see local +cpu wheels (they sort above the CUDA build of the same version).
GPU_PIP_ENV := env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null
GPU_PIP_INSTALL := $(GPU_PIP_ENV) $(GPU_PIP) install -q --disable-pip-version-check

.PHONY: test-gpu gpu-setup gpu-bench

ifeq ($(strip $(GPU_CUDA)),)
# No CUDA device: the normal venv as it is (set up only where it is missing);
# tests/gpu skips every test ("no CUDA device: ...").
test-gpu: | $(if $(wildcard $(PY)),,setup)
	@echo "test-gpu: no CUDA device here (nvidia-smi lists no GPU): running tests/gpu with $(VENV), every test skips"
	$(PY) -m pytest -q -rs tests/gpu

gpu-setup:
	@echo "gpu-setup: no CUDA device here (nvidia-smi lists no GPU): nothing to install"

gpu-bench:
	@echo "gpu-bench: no CUDA device here (nvidia-smi lists no GPU)"; exit 1
else
test-gpu: $(GPU_STAMP)
	$(GPU_PY) -m pytest -q -rs tests/gpu

gpu-setup: $(GPU_STAMP)

# The benchmark on CUDA pools, plus the device-to-device copy limit row.
gpu-bench: $(GPU_STAMP)
	$(GPU_PY) -m benchmarks --device cuda

$(GPU_STAMP): pyproject.toml Makefile mk/gpu.mk | debian-libs
	@test -n "$(GPU_PY_VERSION)" || { echo "$(GPU_PYTHON) does not run here (GPU_PYTHON=python3.X for another)"; exit 1; }
	@echo "gpu-setup: driver CUDA $(GPU_CUDA): torch $(GPU_TORCH_VERSION) from $(GPU_TORCH_INDEX), $(GPU_MOONCAKE_PKG), $(GPU_NIXL_PKG)"
	@test -x $(GPU_PY) || $(GPU_PYTHON) -m venv $(GPU_VENV)
	$(GPU_PIP_INSTALL) --upgrade pip
	$(GPU_PIP_INSTALL) --index-url $(GPU_TORCH_INDEX) torch==$(GPU_TORCH_VERSION)
	$(GPU_PIP_INSTALL) $(GPU_MOONCAKE_PKG)
	$(GPU_PIP_INSTALL) $(GPU_NIXL_PKG)
	$(GPU_PIP_INSTALL) -e '.[test]'
	# A CPU torch, or one whose CUDA this driver cannot run, stops here with the reason.
	$(GPU_PY) -c "import torch; assert torch.version.cuda, 'torch ' + torch.__version__ + ' is a CPU build'; \
		assert torch.cuda.is_available(), 'torch ' + torch.__version__ + ' (CUDA ' + torch.version.cuda + ') sees no GPU: driver CUDA $(GPU_CUDA)'; \
		print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"
	$(GPU_PY) -c "import mooncake.engine, zmq, msgpack; from transfer.transport.mooncake.process import check_engine_build; check_engine_build('cuda')"
	@touch $(GPU_STAMP)
endif
