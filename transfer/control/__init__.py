"""Control channels: the :class:`~transfer.control.base.ControlChannel`
interface, zmq behind it (:mod:`~transfer.control.zmq_channel`, the only
module of ``transfer`` that imports zmq) and an in-process channel for unit
tests (:mod:`~transfer.control.loopback`). Names are imported lazily."""

from bootstrap.lazy import lazy_exports

_EXPORTS = {
    "ControlChannel": "transfer.control.base", "ChannelFactory": "transfer.control.base",
    "Handler": "transfer.control.base",
    "ZmqChannel": "transfer.control.zmq_channel", "LoopbackChannel": "transfer.control.loopback",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
