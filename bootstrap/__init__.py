"""kvferry bootstrap: the registry that prefill ranks register with and decode
ranks look up. Imports neither torch, mooncake nor ``transfer``, so it deploys
alone: ``python -m bootstrap --host H --port P``.

Names are imported lazily: the codec and messages (used by the pure core of
``transfer``) do not pull in zmq.
"""

import importlib

_EXPORTS = {
    "BootstrapClient": "bootstrap.client",
    "BootstrapServer": "bootstrap.server", "DEFAULT_PORT": "bootstrap.server",
    "BootstrapError": "bootstrap.errors", "BootstrapUnavailable": "bootstrap.errors",
    "KVFerryError": "bootstrap.errors", "ProtocolError": "bootstrap.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bootstrap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
