"""Put on PYTHONPATH for the servers of vLLM's own connectors in
``benchmarks.vllm`` (never for kvferry's), to correct what this CPU-only
machine does to them:

- MooncakeConnector's worker asks ``torch.accelerator.current_device_index()``,
  which raises without an accelerator; on a CPU-only machine the answer that
  lets it run is 0.
- As ``harness/vllm_site``, whose ``sitecustomize`` this one shadows: every
  process asks for AMX's tile state (:mod:`harness.amx`), and creates its
  NIXL agents with the progress delay its environment names, if any
  (:mod:`harness.nixl_agents`: the ``nixl-tuned`` row).
"""


def _cpu_device_index() -> None:
    import torch

    orig = torch.accelerator.current_device_index

    def current_device_index() -> int:
        if not torch.accelerator.is_available():
            return 0
        return orig()

    torch.accelerator.current_device_index = current_device_index


try:  # never break interpreter start-up
    _cpu_device_index()
except Exception:
    pass
try:
    from harness.amx import request_amx

    request_amx()
except Exception:
    pass
try:
    from harness.nixl_agents import from_env

    from_env()
except Exception:
    pass
