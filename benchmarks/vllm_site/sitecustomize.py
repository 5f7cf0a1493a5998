"""Put on PYTHONPATH for vLLM's MooncakeConnector servers only (benchmarks.vllm).

Its worker asks ``torch.accelerator.current_device_index()``, which raises
without an accelerator; on a CPU-only machine the answer that lets it run is 0.
"""

try:
    import torch

    _orig = torch.accelerator.current_device_index

    def _current_device_index() -> int:
        if not torch.accelerator.is_available():
            return 0
        return _orig()

    torch.accelerator.current_device_index = _current_device_index
except Exception:  # never break interpreter start-up
    pass
