"""harness.nixl_agents: vLLM's NixlConnector on the harness's servers creates
agents whose progress thread sleeps between polls when the server's
environment names a delay (the tests' reference pair, the benchmark's
``nixl-tuned``); without it, NIXL's thread spins on a core."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.nixl_agents import ENV, TUNED_DELAY_US, connector
from transfer.transport.nixl.api import with_progress_delay

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITE = os.path.join(REPO_ROOT, "harness", "vllm_site")

# A fresh interpreter with the servers' sitecustomize: one real agent (UCX), then its process's CPU over 1 s.
_PROBE = """
import time
import nixl_cu12._api as api
agent = api.nixl_agent("probe", api.nixl_agent_config(backends=["UCX"]))
start = time.process_time()
time.sleep(1.0)
print(getattr(api.nixlBind.nixlAgent, "progress_delay_us", 0), time.process_time() - start)
"""


class _Config:
    pthrDelay = 0


def test_the_wrapped_constructor_passes_the_delay_in_the_agents_config():
    made = []

    class Bindings:
        @staticmethod
        def nixlAgent(name, config):
            made.append((name, config.pthrDelay))
            return "agent"

    delayed = with_progress_delay(Bindings.nixlAgent, 250)
    assert delayed("a", _Config()) == "agent"
    assert made == [("a", 250)] and delayed.progress_delay_us == 250


def _probe(env: dict) -> tuple[int, float]:
    pytest.importorskip("nixl_cu12._api")
    # UCX's EFA module left out as kvferry's transport does (transfer.transport.nixl.api): with it, the
    # probe dies of SIGSEGV at exit, after its answer
    env = {**{k: v for k, v in os.environ.items() if k != ENV}, "PYTHONPATH": os.pathsep.join([SITE, REPO_ROOT]),
           "UCX_MODULES": "^efa", **env}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    return int(out[-2]), float(out[-1])


def test_a_servers_agent_sleeps_between_polls_where_its_environment_names_a_delay():
    tuned_delay, tuned_cpu = _probe({ENV: str(TUNED_DELAY_US)})
    shipped_delay, shipped_cpu = _probe({})
    assert (tuned_delay, shipped_delay) == (TUNED_DELAY_US, 0)
    # measured here: 0.01 CPU-s against 1.0 (a spinning thread, a core to itself)
    assert tuned_cpu < 0.25, f"an idle agent with a {TUNED_DELAY_US} us delay used {tuned_cpu:.2f} CPU-s in 1 s"
    assert shipped_cpu > 4 * tuned_cpu, (shipped_cpu, tuned_cpu)


def test_the_tuned_connector_names_the_delay_and_one_ucx_thread_for_its_side_channel():
    config, env = connector(23456)
    assert config["kv_connector"] == "NixlConnector" and config["kv_connector_extra_config"] == {"num_threads": 1}
    assert env == {"VLLM_NIXL_SIDE_CHANNEL_PORT": "23456", ENV: str(TUNED_DELAY_US)}
    shipped, shipped_env = connector(23457, tuned=False)
    assert "kv_connector_extra_config" not in shipped and shipped_env == {"VLLM_NIXL_SIDE_CHANNEL_PORT": "23457"}
