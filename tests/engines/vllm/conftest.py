"""What several vLLM test modules share: the tiny Llama and its single
instance (the reference), started once for the package (each server start
is ~30 s of this suite's time on two cores; ``test_layerwise.py`` and
``test_pd.py`` compare against the same model). The reference serves plain
requests only, without prefix caching: its answers do not depend on what it
served before."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def tiny_llama(tmp_path_factory):
    """(model directory, the reference server) for the tiny Llama."""
    pytest.importorskip("vllm")
    from harness.vllm import ServerSpec, VLLMServer, build_tiny_model
    from tests.engines.vllm.pd_servers import running

    root = tmp_path_factory.mktemp("vllm-llama")
    model = build_tiny_model(str(root / "model"))
    with running({"reference": VLLMServer(ServerSpec("reference", model, 0), str(root))}) as servers:
        yield model, servers["reference"]
