"""NIXL agents that do not spin, for vLLM's own NixlConnector on the
harness's servers (the tests' reference pair, the benchmark's ``nixl-tuned``).

NIXL's Python API creates every agent with its progress thread's poll delay
(``pthrDelay``) at 0: the thread spins on a core for the agent's whole life
(an idle agent used 3.0 CPU-s in 3 s here, docs/vllm.md). kvferry's own NIXL
transport creates its agents with a delay (:func:`transfer.transport.nixl.api.new_agent`,
the same wrapper for one call);
vLLM's connector cannot be told to. On a 2-core machine a reference pair's
two spinning threads take both cores from every server beside them for the
whole test. A server whose environment names :data:`ENV` (microseconds)
creates its agents with that delay instead: its ``sitecustomize``
(``harness/vllm_site``, ``benchmarks/vllm_site``) calls :func:`from_env`
before vLLM's first import of NIXL.
"""

from __future__ import annotations

import importlib
import os

#: the progress thread's poll delay, in microseconds, for every NIXL agent of the process
ENV = "KVFERRY_HARNESS_NIXL_PROGRESS_DELAY_US"
#: the tuned connector's delay (kvferry's NIXL transport's default) and UCX worker threads (vLLM asks for 4)
TUNED_DELAY_US, TUNED_THREADS = 100, 1
_BINDINGS = ("nixl_cu13._bindings", "nixl_cu12._bindings")


def connector(side_channel_port: int, *, tuned: bool = True) -> tuple[dict, dict]:
    """(kv-transfer config, environment) of vLLM's NixlConnector on one side
    of a pair: as vLLM configures it, or ``tuned`` for a core per server
    (agents that do not spin, one UCX worker thread), which moves the same
    bytes the same way."""
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port)}
    if tuned:
        config["kv_connector_extra_config"] = {"num_threads": TUNED_THREADS}
        env[ENV] = str(TUNED_DELAY_US)
    return config, env


def from_env() -> int:
    """With :data:`ENV` set: every NIXL build installed gets the delay
    (:func:`transfer.transport.nixl.api.with_progress_delay` on its
    binding's constructor, for good). Returns the delay, 0 where none was set
    or NIXL is not installed. What vLLM sets before its own first import of
    NIXL (``vllm/distributed/nixl_utils.py``) is set first, as this import
    now precedes it."""
    delay_us = int(os.environ.get(ENV) or 0)
    if delay_us <= 0:
        return 0
    # imported here: every process of every harness server runs this module at start-up
    from transfer.transport.nixl.api import with_progress_delay

    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    found = False
    for name in _BINDINGS:
        try:
            bindings = importlib.import_module(name)
        except ImportError:
            continue
        bindings.nixlAgent = with_progress_delay(bindings.nixlAgent, delay_us)
        found = True
    return delay_us if found else 0
