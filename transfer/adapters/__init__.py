"""Adapters that make kvferry the transfer backend of a serving engine.

Each subpackage imports its engine; it is only importable where that engine
is installed (``pip install 'kvferry[sglang]'``). The library itself never
imports an adapter.
"""
