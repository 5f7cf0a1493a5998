"""The architecture's import rules, checked in fresh interpreters."""

import ast
import subprocess
import sys
from pathlib import Path

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


def test_the_library_imports_neither_the_benchmark_nor_the_harness():
    """Every module of the installed packages, imported in one interpreter,
    loads nothing from ``benchmarks`` or ``harness`` (they are not installed).
    A module of an optional backend whose dependency is missing is skipped."""
    code = """
import importlib, pkgutil, bootstrap, transfer
for pkg in (bootstrap, transfer):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            if (exc.name or "").split(".")[0] not in ("nixl", "nixl_cu12", "kvikio", "cufile", "vllm"):
                raise
"""
    loaded = _modules_after(code)
    assert "transfer.storage.file" in loaded and "transfer.manager" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("benchmarks", "harness", "examples", "tests")}


def test_no_library_source_names_the_benchmark_or_the_harness():
    """Also lazy imports inside functions: the library's source has no import
    of ``benchmarks``, ``harness``, ``examples`` or ``tests``."""
    root = Path(__file__).resolve().parents[2]
    sources = [p for pkg in ("bootstrap", "transfer") for p in (root / pkg).rglob("*.py")]
    assert len(sources) > 20
    offending = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offending += [f"{path.relative_to(root)}:{node.lineno} imports {n}" for n in names
                          if n.split(".")[0] in ("benchmarks", "harness", "examples", "tests")]
    assert not offending
