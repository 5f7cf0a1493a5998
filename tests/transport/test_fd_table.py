"""A Mooncake transport grows its process's file-descriptor table before
the engine starts (``reserve_fd_table``): no data connection the engine's
I/O thread accepts later makes the kernel grow it, which in a process with
threads waits for an RCU grace period inside that ``accept()`` while every
session of the engine waits (docs/reliability.md, "A stalled first write").
Each case runs in a fresh process with a second thread (a shared table),
read from the kernel's ``FDSize``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("mooncake.engine")

from harness.launch import child_env  # noqa: E402

_PROBE = r"""
import json, os, resource, sys, threading
stop = threading.Event(); threading.Thread(target=stop.wait, daemon=True).start()
def fdsize():
    return int(next(l for l in open("/proc/self/status") if l.startswith("FDSize")).split()[1])
limit = int(sys.argv[1])
if limit:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
mine = [os.open(os.devnull, os.O_RDONLY) for _ in range(5)]
before = fdsize()
out = {"before": before}
if sys.argv[2] == "reserve":
    from transfer.transport.mooncake.process import reserve_fd_table
    out["reserved"] = reserve_fd_table()
else:
    from transfer.config import EngineConfig
    from transfer.transport.mooncake.transport import MooncakeTransport
    t = MooncakeTransport(EngineConfig(protocol="tcp"))
out["after"] = fdsize()
out["mine_open"] = all(os.path.exists(f"/proc/self/fd/{fd}") for fd in mine)
out["open_fds"] = len(os.listdir("/proc/self/fd"))
print(json.dumps(out))
os._exit(0)
"""


def _probe(limit: int, what: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _PROBE, str(limit), what], env=child_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_mooncake_transport_grows_the_table_before_its_engine_starts():
    out = _probe(0, "transport")
    assert out["before"] < 4096 <= out["after"], out
    assert out["mine_open"], out


def test_the_reserve_closes_what_it_opened_and_replaces_nothing():
    out = _probe(0, "reserve")
    assert out["reserved"] == 4096 and out["before"] < 4096 <= out["after"], out
    assert out["mine_open"] and out["open_fds"] < 64, out


def test_a_low_descriptor_limit_bounds_the_reserve():
    out = _probe(512, "reserve")
    assert out["reserved"] == 512 and 512 <= out["after"] < 4096, out
