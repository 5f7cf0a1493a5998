"""Put on PYTHONPATH for the servers of vLLM's own connectors in
``benchmarks.vllm`` (never for kvferry's), to correct what this CPU-only
machine does to them:

- MooncakeConnector's worker asks ``torch.accelerator.current_device_index()``,
  which raises without an accelerator; on a CPU-only machine the answer that
  lets it run is 0.
- With ``KVFERRY_BENCH_NIXL_PROGRESS_DELAY_US`` set (the ``nixl-tuned`` row):
  NIXL's Python API creates every agent with its progress thread's poll delay
  (``pthrDelay``) at 0, so that thread spins on a core; on a machine with a
  core per server that core is the engine's own. The agent is created with
  the delay given instead (kvferry's NIXL transport uses 100 us,
  ``transfer/transport/nixl/api.py``).
- As ``harness/vllm_site``, whose ``sitecustomize`` this one shadows: every
  process asks for AMX's tile state (:mod:`harness.amx`).
"""

import os


def _cpu_device_index() -> None:
    import torch

    orig = torch.accelerator.current_device_index

    def current_device_index() -> int:
        if not torch.accelerator.is_available():
            return 0
        return orig()

    torch.accelerator.current_device_index = current_device_index


def _nixl_progress_delay(delay_us: int) -> None:
    # What vLLM sets before its own first import of NIXL (vllm/distributed/nixl_utils.py),
    # which this import now precedes.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    import importlib

    for name in ("nixl_cu13", "nixl_cu12"):
        try:
            bindings = importlib.import_module(f"{name}._bindings")
        except ImportError:
            continue
        real = bindings.nixlAgent

        def agent(agent_name, config, _real=real):
            config.pthrDelay = delay_us
            return _real(agent_name, config)

        bindings.nixlAgent = agent


try:  # never break interpreter start-up
    _cpu_device_index()
except Exception:
    pass
try:
    if os.environ.get("KVFERRY_BENCH_NIXL_PROGRESS_DELAY_US"):
        _nixl_progress_delay(int(os.environ["KVFERRY_BENCH_NIXL_PROGRESS_DELAY_US"]))
except Exception:
    pass
try:
    from harness.amx import request_amx

    request_amx()
except Exception:
    pass
