"""Building the transport ``EngineConfig.backend`` names: the one place that
chooses between the engines (the manager, the benchmark and tools call
:func:`build_transport`). Engines are imported when a transport is built."""

from __future__ import annotations

from transfer.config import EngineConfig
from transfer.errors import TransferError
from transfer.transport.base import Transport


def build_transport(engine: EngineConfig, device_type: str = "cpu") -> Transport:
    """A new, unregistered transport for ``engine`` whose memory lies on
    ``device_type`` (``cpu``, ``cuda``). TransferError when the engine is
    missing or cannot move that memory."""
    if engine.backend == "nixl":
        if device_type != "cpu":
            raise TransferError(f"the NIXL transport moves host memory only so far; the pools are {device_type} "
                                "memory (use EngineConfig(backend='mooncake'))")
        from transfer.transport.nixl.transport import NixlTransport
        return NixlTransport(engine)
    from transfer.transport.mooncake.process import check_engine_build
    from transfer.transport.mooncake.transport import MooncakeTransport
    check_engine_build(device_type)  # the non-CUDA wheel cannot read HBM
    return MooncakeTransport(engine)
