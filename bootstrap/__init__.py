"""kvferry bootstrap: the registry that prefill ranks register with and decode
ranks look up. Imports neither torch, mooncake nor ``transfer``, so it deploys
alone: ``python -m bootstrap --host H --port P``; ``python -m bootstrap status
--addr H:P`` shows what a server has registered (see docs/bootstrap.md).

Names are imported lazily: the codec and messages (used by the pure core of
``transfer``) do not pull in zmq.
"""

from bootstrap.lazy import lazy_exports

_EXPORTS = {
    "BootstrapClient": "bootstrap.client",
    "BootstrapServer": "bootstrap.server", "DEFAULT_PORT": "bootstrap.server", "ServerConfig": "bootstrap.server",
    "BootstrapError": "bootstrap.errors", "BootstrapUnavailable": "bootstrap.errors",
    "BootstrapRefused": "bootstrap.errors", "UnknownNodeError": "bootstrap.errors",
    "InsecureBindError": "bootstrap.errors", "is_loopback_host": "bootstrap.protect",
    "KVFerryError": "bootstrap.errors", "ProtocolError": "bootstrap.errors", "AuthError": "bootstrap.errors",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
