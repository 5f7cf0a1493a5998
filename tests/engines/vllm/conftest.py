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
    """(model directory, the reference server) for the tiny Llama; the
    server is started, not waited for."""
    pytest.importorskip("vllm")
    from harness.vllm import ServerSpec, VLLMServer, build_tiny_model

    root = tmp_path_factory.mktemp("vllm-llama")
    model = build_tiny_model(str(root / "model"))
    reference = VLLMServer(ServerSpec("reference", model, 0), str(root))
    try:
        yield model, reference  # starting: its first user waits for it beside its own servers (``running``)
    finally:
        reference.close()
