"""The GPU suite: CUDA pools through the real engine and the storage backends.

Every test here is skipped, with the reason, unless this process sees a
CUDA device through a CUDA build of torch ("no CUDA device: ..."); the tests
that move bytes through Mooncake also need a CUDA build of the engine
(``make test-gpu`` sets both up in ``.venv-gpu/``). Without a GPU the whole
suite is collected and skipped in seconds (mostly the import of torch, which
the rest of the suite pays anyway), so the default
``pytest`` run keeps it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def no_cuda_reason() -> str | None:
    """Why CUDA cannot be used here (None: it can)."""
    try:
        import torch
    except ImportError as exc:
        return f"no CUDA device: torch is not importable ({exc})"
    if not torch.version.cuda:
        return f"no CUDA device: torch {torch.__version__} is a CPU build (make test-gpu installs a CUDA one)"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return None


def no_cuda_engine_reason() -> str | None:
    """Why the Mooncake engine here cannot move CUDA memory (None: it can)."""
    from transfer.errors import TransferError
    from transfer.transport.mooncake.process import check_engine_build
    try:
        check_engine_build("cuda")
    except TransferError as exc:
        return f"no CUDA Mooncake engine: {exc}"
    return None


NO_CUDA = no_cuda_reason()


def pytest_collection_modifyitems(config, items):
    if NO_CUDA is None:
        return
    skip = pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(skip)


@pytest.fixture
def cuda_engine():
    """Skip unless the installed Mooncake wheel is a CUDA build."""
    reason = no_cuda_engine_reason()
    if reason:
        pytest.skip(reason)
