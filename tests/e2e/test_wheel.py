"""kvferry as a user installs it: ``pip wheel .``, then ``pip install`` of that
wheel into a new virtual environment (not editable), from which every module
imports and one room moves between two processes.

The new environment is made without pip and sees the dependencies (torch,
zmq, msgpack, Mooncake) through one ``.pth`` line naming this interpreter's
site-packages. A path line in a ``.pth`` file is only appended to
``sys.path``; the ``.pth`` files in that directory (the editable install of
kvferry among them) are not run, so the only kvferry the new environment can
import is the wheel's. Its processes run from a temporary directory with no
``PYTHONPATH``, and each checks where ``transfer`` came from.
"""

from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
LIBRARY = ("bootstrap", "transfer")
WORKSHOP = ("benchmarks", "harness", "tests", "examples")
#: Dependencies of optional backends: a module may fail to import for want of these only.
OPTIONAL_DEPS = ("nixl", "nixl_cu12", "kvikio", "cufile", "sglang", "vllm")  # the optional extras
STEP_S = 120  # bound on each subprocess (build, install, one room)

IMPORT_ALL = textwrap.dedent("""
    import importlib, pkgutil, sys
    import bootstrap, transfer
    optional, repo = set(sys.argv[1].split(",")), sys.argv[2]
    assert transfer.__file__.startswith(sys.prefix), f"transfer from {transfer.__file__}, not {sys.prefix}"
    assert bootstrap.__file__.startswith(sys.prefix), f"bootstrap from {bootstrap.__file__}"
    assert not [p for p in sys.path if p and p.rstrip("/") == repo], f"the repository is on sys.path: {sys.path}"
    done, skipped = [], []
    for pkg in (bootstrap, transfer):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            try:
                importlib.import_module(info.name)
                done.append(info.name)
            except ImportError as exc:
                if (exc.name or "").split(".")[0] not in optional:
                    raise
                skipped.append(f"{info.name} ({exc.name})")
    print("IMPORTED", " ".join(done))
    print("SKIPPED", " ".join(skipped))
""")

# One room, prefill and decode in two processes of the new environment:
# random pool bytes and random page indices from a shared seed, sent in two
# chunks, compared exactly on decode (pages and aux row; untouched pages stay zero).
ROOM = textwrap.dedent("""
    import sys, time
    import numpy as np, torch
    import transfer
    from transfer import EngineConfig, KVManager, KVPoll, KVReceiver, KVSender, ManagerConfig, MHAPool, Role

    role, bootstrap_addr, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    assert transfer.__file__.startswith(sys.prefix), transfer.__file__
    LAYERS, PAGES, PAGE_TOKENS, HEADS, HEAD_DIM, ROOM_PAGES, ROOM, AUX_BYTES = 2, 24, 16, 4, 64, 9, 4242, 32
    rng = np.random.default_rng(seed)

    def random_pool():  # float16 pages from random bytes
        return [torch.from_numpy(rng.integers(0, 256, (PAGES, PAGE_TOKENS, HEADS, HEAD_DIM * 2), dtype=np.uint8))
                .view(torch.float16) for _ in range(2 * LAYERS)]

    src_bufs = random_pool()
    src_pages = rng.choice(PAGES, ROOM_PAGES, replace=False)
    dst_pages = rng.choice(PAGES, ROOM_PAGES, replace=False)
    aux_row = torch.from_numpy(rng.integers(0, 256, AUX_BYTES, dtype=np.uint8))
    src_slot, dst_slot = 3, 5

    def wait(room, until):
        deadline = time.monotonic() + 60
        while (state := room.poll()) is not until:
            if state is KVPoll.Failed:
                room.failure_exception()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{role}: room in {state.name} after 60 s, waiting for {until.name}")
            time.sleep(0.002)

    engine = EngineConfig(protocol="tcp", hostname="127.0.0.1")
    config = ManagerConfig(role=Role.PREFILL if role == "prefill" else Role.DECODE, bootstrap_addr=bootstrap_addr,
                           engine=engine, staging_bytes=8 << 20, stage_part_bytes=4 << 20)
    aux = torch.zeros(8, AUX_BYTES, dtype=torch.uint8)
    if role == "prefill":
        bufs = src_bufs
        aux[src_slot] = aux_row
    else:
        bufs = [torch.zeros_like(t) for t in src_bufs]
    pool = MHAPool(k=bufs[0::2], v=bufs[1::2], total_kv_heads=HEADS)
    with KVManager(config, [pool], aux=aux) as mgr:
        if role == "prefill":
            sender = KVSender(mgr, bootstrap_addr, ROOM)
            wait(sender, KVPoll.WaitingForInput)
            sender.init(ROOM_PAGES, aux_index=src_slot)
            sender.send(src_pages[:4])
            sender.send(src_pages[4:], last=True)
            wait(sender, KVPoll.Success)
            print("SENT", mgr.transport.num_bytes, flush=True)
        else:
            with mgr.bootstrap_client(bootstrap_addr) as client:  # both start at once: wait for prefill
                deadline = time.monotonic() + 60
                while not client.lookup(config.node_id, 0).ready and time.monotonic() < deadline:
                    time.sleep(0.05)
            receiver = KVReceiver(mgr, bootstrap_addr, ROOM, prefill_node=config.node_id)
            receiver.init(dst_pages, aux_index=dst_slot)
            wait(receiver, KVPoll.Success)
            untouched = sorted(set(range(PAGES)) - set(dst_pages.tolist()))
            for i, (got, want) in enumerate(zip(bufs, src_bufs)):
                assert torch.equal(got[dst_pages].view(torch.uint8), want[src_pages].view(torch.uint8)), f"buffer {i}"
                assert not got[untouched].view(torch.uint8).any(), f"buffer {i}: a page outside the room was written"
            assert torch.equal(aux[dst_slot], aux_row), "aux row"
            print("RECEIVED", sum(t[dst_pages].numel() * t.element_size() for t in bufs), flush=True)
""")


def _run(argv, cwd, env, what):
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=STEP_S)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _build_wheel(tmp: Path) -> Path:
    """``pip wheel`` of a copy of the repository (an in-tree build would reuse
    a stale ``build/`` and write into the checkout)."""
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "bench-*.json"))
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-q", "-w", str(dist), str(src)], tmp, _clean_env(), "pip wheel")
    wheels = list(dist.glob("kvferry-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _new_venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, _clean_env(), "venv")
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp, _clean_env(), "sysconfig").strip())
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "kvferry_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
          "--disable-pip-version-check", "-q", str(wheel)], tmp, _clean_env(), "pip install")
    return venv


def _start_bootstrap(venv: Path, cwd: Path) -> tuple[subprocess.Popen, str]:
    """The installed console script, on a free loopback port."""
    proc = subprocess.Popen([str(venv / "bin" / "kvferry-bootstrap"), "--host", "127.0.0.1", "--port", "0"],
                            cwd=cwd, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline() if sel.select(30) else ""
    if "listening on" not in line:
        proc.kill()
        pytest.fail(f"the installed bootstrap server did not start within 30 s: {line!r}")
    return proc, line.split()[-1]


def test_wheel_installs_imports_and_moves_a_room(tmp_path):
    wheel = _build_wheel(tmp_path)

    # The wheel holds the library, all of it, and nothing else.
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {*LIBRARY, "kvferry-0.1.0.dist-info"}, tops
    assert not [n for n in names if set(n.split("/")[:-1]) & set(WORKSHOP)]
    shipped = {n for n in names if n.endswith(".py")}
    source = {p.relative_to(tmp_path / "src").as_posix() for pkg in LIBRARY
              for p in (tmp_path / "src" / pkg).rglob("*.py") if "__pycache__" not in p.parts}
    assert "transfer/storage/base.py" in shipped
    assert shipped == source, f"missing: {sorted(source - shipped)}, extra: {sorted(shipped - source)}"

    venv = _new_venv(tmp_path, wheel)
    python = str(venv / "bin" / "python")
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    out = _run([python, "-c", IMPORT_ALL, ",".join(OPTIONAL_DEPS), str(REPO)], run_dir, _clean_env(), "import all")
    imported = set(out.split("IMPORTED", 1)[1].split("SKIPPED")[0].split())
    expected = {p.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in shipped} - set(LIBRARY)
    skipped = out.split("SKIPPED", 1)[1].split()
    assert imported | {s for s in skipped if not s.startswith("(")} == expected, out

    script = run_dir / "room.py"
    script.write_text(ROOM)
    server, address = _start_bootstrap(venv, run_dir)
    try:
        procs = {role: subprocess.Popen([python, str(script), role, address, "20260"], cwd=run_dir, env=_clean_env(),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for role in ("prefill", "decode")}
        outs = {}
        for role, proc in procs.items():
            try:
                outs[role] = proc.communicate(timeout=STEP_S)[0]
            except subprocess.TimeoutExpired:
                for p in procs.values():
                    p.kill()
                pytest.fail(f"the {role} process did not finish within {STEP_S} s")
        for role, proc in procs.items():
            assert proc.returncode == 0, f"{role} failed:\n{outs[role][-3000:]}"
    finally:
        server.terminate()
        server.wait(timeout=10)
    received = int(outs["decode"].split("RECEIVED")[1].split()[0])
    sent = int(outs["prefill"].split("SENT")[1].split()[0])
    assert received == 2 * 2 * 9 * 16 * 4 * 64 * 2  # K and V of 2 layers, 9 pages of 16 x 4 x 64 float16
    assert sent >= received
