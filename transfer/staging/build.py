"""A rank's staging memory, built in one place: how much, on which device,
and whether it is fenced (the write fence: a decode rank's peers then write
only into its staging arenas, never into its pools; see
:mod:`transfer.staging.arenas`). What is decided here is read everywhere
else from :class:`~transfer.staging.area.StagingMemory` (``fenced``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from transfer.config import ManagerConfig, Role, staging_bytes_for
from transfer.pools import pool_tensors
from transfer.staging.area import StagingArea, StagingMemory
from transfer.staging.arenas import StagingArenas, arena_layout, span_tensor
from transfer.staging.hostmem import host_tensor

Regions = Callable[[list[tuple[int, int]]], None]


def build_staging(config: ManagerConfig, pools: Sequence, device_type: str, register_arena: Regions,
                  unregister_arena: Regions) -> StagingMemory | None:
    """The staging memory of a rank with ``pools`` on ``device_type``:
    ``config.staging_bytes`` (None: the device's default; 0: none, None is
    returned). Fenced on a decode rank with ``config.write_fence``: a span of
    arenas, each registered with ``register_arena([(addr, nbytes)])`` as it
    opens and ``unregister_arena`` when it is retired; otherwise one tensor
    that the caller registers with its pools (``memory.descriptor``).
    Host memory is left untouched: its pages fault in as parts first use
    them (``StagingMemory.touch`` faults them in now)."""
    nbytes = staging_bytes_for(config, device_type)
    if not nbytes:
        return None
    buffers = pool_tensors(pools)  # (role, layer, component) -> tensor, for gather and scatter
    device = next(iter(buffers.values())).device
    if config.write_fence and config.role is Role.DECODE:
        arena_bytes, num_arenas = arena_layout(nbytes, config.stage_part_bytes)
        span = span_tensor(arena_bytes, num_arenas, device)
        area = StagingArenas(span, arena_bytes, num_arenas, register_arena, unregister_arena)
        return StagingMemory(span, area, buffers, fenced=True)
    if device.type == "cpu":  # huge pages: the engine's kernel copies run faster (see hostmem)
        tensor = host_tensor(nbytes, fill=None)
    else:
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return StagingMemory(tensor, StagingArea(nbytes), buffers)
