"""Put on PYTHONPATH for the servers of SGLang's own ``mooncake`` backend in
``benchmarks.sglang_router`` (never for kvferry's), to correct what this
CPU-only machine does to it:

- SGLang's prefill (0.5.23, ``disaggregation/prefill.py``) gives a sender
  that says ``supports_host_tensor_indices`` its page indices in a pinned
  host tensor copied without blocking, with a ``torch.cuda.Event``: pinning
  raises without an accelerator (``pin_memory=True requires a CUDA or other
  accelerator backend``) and the prefill scheduler dies on the first
  transfer. With the attribute off, prefill takes its other branch (the
  indices computed on the scheduler's thread, as it does for every other
  backend, kvferry's included); nothing else of the backend changes.
- The torchvision stand-in every SGLang process here needs
  (``tests/engines/sglang/stubs``; one ``sitecustomize`` is loaded per
  interpreter, so this one runs that one first).
"""

import os
import runpy

_HERE = os.path.dirname(os.path.abspath(__file__))
runpy.run_path(os.path.join(_HERE, "..", "..", "tests", "engines", "sglang", "stubs", "sitecustomize.py"))

_TARGET = "sglang.srt.disaggregation.mooncake.conn"


def _no_host_tensor_indices(module) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


runpy.run_path(os.path.join(_HERE, "..", "..", "harness", "after_import.py"))["install"]({_TARGET: _no_host_tensor_indices})
