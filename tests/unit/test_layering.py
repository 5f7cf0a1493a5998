"""The architecture's import rules, checked in fresh interpreters."""

import subprocess
import sys

import pytest


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True, timeout=60)
    return set(out.stdout.split())


PURE = ["transfer.config", "transfer.errors", "transfer.layout", "transfer.messages", "transfer.plan",
        "transfer.state", "transfer.tp", "bootstrap.codec", "bootstrap.messages", "bootstrap.registry"]


@pytest.mark.parametrize("module", PURE)
def test_pure_core_imports_neither_zmq_nor_mooncake(module):
    loaded = _modules_after(f"import {module}")
    assert module in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("zmq", "mooncake", "torch")}


def test_bootstrap_server_deploys_without_torch_mooncake_or_transfer():
    loaded = _modules_after("import bootstrap.__main__, bootstrap.server, bootstrap.client")
    assert "bootstrap.server" in loaded and "zmq" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "mooncake", "transfer")}


def test_the_public_api_is_exported():
    loaded = _modules_after("from transfer import KVManager, KVSender, KVReceiver, KVPoll, MHAPool, MLAPool")
    assert "transfer.manager" in loaded
