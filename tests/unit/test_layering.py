"""The architecture's import rules, checked in fresh interpreters and on the
source (ast)."""

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
        "transfer.state", "transfer.tp", "bootstrap.codec", "bootstrap.messages", "bootstrap.registry",
        "transfer.rooms.decode_phases", "transfer.transport.base", "transfer.control.base", "transfer.changes",
        "transfer.stats", "transfer.ready", "bootstrap.descriptors", "transfer.rooms.request_acks",
        "transfer.rooms.room_requests", "transfer.rooms.chunk_sequence", "transfer.rooms.room_writes",
        "transfer.rooms.decode_notice", "transfer.rooms.early_messages",
        "transfer.rooms.decode_link", "transfer.rooms.decode_ending",
        "transfer.rooms.routes", "transfer.rooms.decode_request", "transfer.round_times", "transfer.rooms.parts",
        "transfer.control.hand_over", "transfer.change_feed"]


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
            if (exc.name or "").split(".")[0] not in ("nixl", "nixl_cu12", "kvikio", "cufile", "sglang", "vllm"):
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


ROOM_LAYER = ["transfer.rooms.context", "transfer.rooms.prefill_table", "transfer.rooms.decode_peers", "transfer.rooms.decode_table",
              "transfer.rooms.links", "transfer.rooms.handshakes", "transfer.rooms.lookups", "transfer.rooms.routes",
              "transfer.rooms.decode_phases", "transfer.rooms.decode_request", "transfer.rooms.room_storage",
              "transfer.rooms.chunk_plan", "transfer.rooms.parts", "transfer.rooms.drain", "transfer.rooms.write_through",
              "transfer.rooms.request_acks", "transfer.staging.area", "transfer.staging.copies",
              "transfer.rooms.room_requests", "transfer.rooms.chunk_sequence", "transfer.rooms.room_writes",
              "transfer.rooms.decode_notice", "transfer.rooms.early_messages",
              "transfer.rooms.decode_link", "transfer.rooms.decode_ending", "transfer.rooms.decode_transfer",
              "transfer.rooms.decode_storage",
              "transfer.staging.build", "transfer.rooms.staged_prefill", "transfer.rooms.staged_decode",
              "transfer.rooms.sender", "transfer.rooms.receiver", "transfer.rank.watch", "transfer.rank_memory",
              "transfer.transport.base", "transfer.transport.worker", "transfer.transport.loopback",
              "transfer.control.base", "transfer.control.loopback", "transfer.transport", "transfer.control",
              "transfer.transport.factory",  # the engines are imported when a transport is built
              "transfer.transport.mooncake", "transfer.transport.mooncake.transport", "transfer.transport.mooncake.writes",
              "transfer.transport.nixl", "transfer.transport.nixl.transport", "transfer.transport.nixl.writes"]


# One interpreter imports what every room-layer module needs and neither zmq
# nor Mooncake loads (numpy, torch: seconds of imports), then forks a fresh child
# per module; each child imports its module and reports sys.modules. Same
# question as a fresh interpreter per module, without importing torch 19 times.
_FORK_EACH = """
import os, sys
import numpy, torch
print("PRELOADED", " ".join(m for m in sys.modules if m.split(".")[0] in ("zmq", "mooncake")), flush=True)
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            __import__(name)
            text = "OK " + " ".join(sys.modules)
        except BaseException as exc:
            text = f"ERROR {type(exc).__name__}: {exc}"
        with os.fdopen(w, "w") as f:
            f.write(text)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    print("MODULE", name, text.replace("\\n", " "), flush=True)
"""


@pytest.fixture(scope="module")
def room_layer_modules() -> dict[str, set[str]]:
    out = subprocess.run([sys.executable, "-c", _FORK_EACH, *ROOM_LAYER], capture_output=True, text=True,
                         check=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["PRELOADED"], lines[0]  # numpy and torch loaded neither
    loaded = {}
    for line in lines[1:]:
        _, name, status, *rest = line.split()
        assert status == "OK", line
        loaded[name] = set(rest)
    assert sorted(loaded) == sorted(ROOM_LAYER)
    return loaded


@pytest.mark.parametrize("module", ROOM_LAYER)
def test_the_room_layer_loads_neither_zmq_nor_mooncake(module, room_layer_modules):
    """Rooms, staging and the loopback pair run without zmq or Mooncake: the
    engines come in only through the manager's seams. (The bootstrap client,
    zmq, reaches the rooms as a factory in their context.)"""
    loaded = room_layer_modules[module]
    assert module in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("zmq", "mooncake")}


ROOT = Path(__file__).resolve().parents[2]


def _library_files() -> list[Path]:
    return [p for pkg in ("transfer", "bootstrap") for p in sorted((ROOT / pkg).rglob("*.py"))]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere (functions and TYPE_CHECKING
    blocks included), absolute or relative, as dotted names."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # ``from pkg import module``
    return found


def test_only_the_engine_modules_import_zmq_and_mooncake():
    allowed = {"zmq": {"transfer/control/zmq_channel.py", "transfer/control/router_discovery.py", "bootstrap/client.py",
                       "bootstrap/server.py", "bootstrap/listen.py"},
               "mooncake": {"transfer/transport/mooncake/transport.py", "transfer/storage/mooncake/store.py"}}
    for path in _library_files():
        rel = path.relative_to(ROOT).as_posix()
        for engine, files in allowed.items():
            if any(m.split(".")[0] == engine for m in _imports(path)):
                assert rel in files, f"{rel} imports {engine}"


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for d in graph[m]:
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            component = set()
            while True:
                x = stack.pop()
                component.add(x)
                if x == m:
                    break
            if len(component) > 1:
                found.append(component)

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return found


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_transfer_or_bootstrap():
    files = {_module_name(p): p for p in _library_files()}
    assert len(files) > 40 and "transfer.rooms.decode_table" in files
    graph = {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}
    # A module's package __init__ runs first; a module importing its own package is not a cycle.
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}
    cycles = _cycles(graph)
    assert not cycles, f"import cycles: {cycles}"


def _package(module: str) -> str:
    """The package a module of the library belongs to (``transfer.rooms``,
    ``transfer.transport``, ...); a module at the root of ``transfer`` or
    ``bootstrap`` is its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (ROOT / Path(*parts)).is_dir() else module


def test_no_import_cycles_between_the_packages():
    """Collapsed to packages, the import graph has no cycle either: rooms
    use staging, storage uses the transports' engine plumbing, never back."""
    files = {_module_name(p): p for p in _library_files()}
    graph: dict[str, set[str]] = {}
    for m, p in files.items():
        deps = {_package(i) for i in _imports(p) if i in files}
        graph.setdefault(_package(m), set()).update(deps - {_package(m)})
    for deps in graph.values():
        deps &= graph.keys()
    cycles = _cycles(graph)
    assert not cycles, f"package cycles: {cycles}"
    assert {"transfer.rooms", "transfer.staging", "transfer.transport", "transfer.storage"} <= graph.keys()


VLLM = "transfer.adapters.vllm"
#: the vLLM connector's modules that run in vLLM's scheduler process, or are pure helpers: no torch,
#: no zmq, no Mooncake, none of kvferry's rooms, transports or manager, and no worker half
VLLM_SCHEDULER_SIDE = ("scheduler", "metadata", "params", "groups", "layerwise", "stats", "query",
                       "tier", "tier_keys", "tier_lookups", "tier_thread")  # the tier: OffloadingConnector's, in the scheduler


@pytest.mark.parametrize("name", VLLM_SCHEDULER_SIDE)
def test_the_vllm_connectors_scheduler_side_imports_no_engine_and_no_worker(name):
    path = ROOT / "transfer" / "adapters" / "vllm" / f"{name}.py"
    banned = ("torch", "zmq", "mooncake", "transfer.manager", "transfer.rooms", "transfer.transport",
              "transfer.staging", "transfer.pools", f"{VLLM}.worker", f"{VLLM}.prefill_worker",
              f"{VLLM}.decode_worker", f"{VLLM}.caches", f"{VLLM}.connector")
    bad = sorted(m for m in _imports(path) if any(m == b or m.startswith(b + ".") for b in banned))
    assert not bad, f"{VLLM}.{name} imports {bad}"


def test_each_vllm_worker_half_knows_only_its_own_role():
    """The prefill and decode workers share the base and never reach into
    each other; the base names neither; the facade alone picks a role."""
    here = ROOT / "transfer" / "adapters" / "vllm"
    for name, other in (("prefill_worker", "decode_worker"), ("decode_worker", "prefill_worker"),
                        ("worker", "prefill_worker"), ("worker", "decode_worker")):
        assert f"{VLLM}.{other}" not in _imports(here / f"{name}.py"), f"{name} imports {other}"
    roles = {name: "Role.PREFILL" in (here / f"{name}.py").read_text() or "is_producer" in (here / f"{name}.py").read_text()
             for name in ("worker", "decode_worker", "scheduler", "caches", "metadata")}
    assert not any(roles.values()), f"role tests inside a half: {[n for n, r in roles.items() if r]}"
