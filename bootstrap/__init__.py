"""kvferry bootstrap: the registry that prefill ranks register with and decode
ranks look up. Imports neither torch, mooncake nor ``transfer``, so it deploys
alone: ``python -m bootstrap --host H --port P``."""

from bootstrap.client import BootstrapClient
from bootstrap.errors import BootstrapError, BootstrapUnavailable, KVFerryError, ProtocolError
from bootstrap.server import DEFAULT_PORT, BootstrapServer

__all__ = [
    "BootstrapClient", "BootstrapError", "BootstrapServer", "BootstrapUnavailable",
    "DEFAULT_PORT", "KVFerryError", "ProtocolError",
]
