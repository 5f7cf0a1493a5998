"""Adapters that plug kvferry into serving engines.

Each adapter is its own module and imports its engine only when imported
itself (``transfer.adapters.vllm`` imports vLLM); this package imports nothing.
"""
