"""Adapters that make kvferry the transfer backend of a serving engine.

Each adapter imports its engine only when imported itself
(``transfer.adapters.vllm``'s connector imports vLLM, ``transfer.adapters.sglang``
SGLang): it is only importable where that engine is installed
(``pip install 'kvferry[vllm]'`` / ``'kvferry[sglang]'``). This package and
the library itself import no adapter.
"""
