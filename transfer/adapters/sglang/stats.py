"""Per-room transfer statistics, from which ``get_transfer_metric()`` is filled:
the core's ``KVSender.stats()`` in the shape the adapter reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RoomStats:
    bytes: int = 0
    descriptors: int = 0
