"""Transports: the :class:`~transfer.transport.base.Transport` interface, the
Mooncake engine behind it (:mod:`~transfer.transport.mooncake`) and an
in-process memcpy for unit tests (:mod:`~transfer.transport.loopback`).

Importing this package imports no engine (Mooncake is imported when a
:class:`MooncakeTransport` is built); ``transfer.transport.MooncakeTransport``
keeps the name the module ``transfer/transport.py`` had.
"""

from bootstrap.lazy import lazy_exports

_EXPORTS = {
    "DoneCallback": "transfer.transport.base", "Transport": "transfer.transport.base",
    "TransferHandle": "transfer.transport.base",
    "MooncakeTransport": "transfer.transport.mooncake",
    "LoopbackFabric": "transfer.transport.loopback", "LoopbackTransport": "transfer.transport.loopback",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
