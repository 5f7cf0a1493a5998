"""The ``mooncake://`` store's configuration (pure: imports neither Mooncake
nor torch). The options of a ``mooncake://`` URL are these fields."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MooncakeStoreConfig"]


@dataclass(frozen=True, kw_only=True)
class MooncakeStoreConfig:
    """One client of a Mooncake Store cluster.

    ``master_addr`` is the master's ``host:port``. ``metadata_server`` is
    ``P2PHANDSHAKE`` or the master's HTTP metadata URL. ``local_hostname`` is
    the address other clients reach this one at. ``global_segment_size``:
    bytes this client contributes to the pool (0: none); ``local_buffer_size``:
    the Store's own buffer for its bytes API (unused by kvferry's calls but
    required). ``bounce_bytes``: the host buffer that overwrites go through.
    """

    master_addr: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 0
    local_buffer_size: int = 16 << 20
    replica_num: int = 1
    max_entries_per_call: int = 1024
    bounce_bytes: int = 64 << 20
    call_timeout_s: float = 30.0
    setup_timeout_s: float = 10.0
    close_timeout_s: float = 10.0
    log_level: str = "ERROR"

    def __post_init__(self) -> None:
        host, _, port = self.master_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"MooncakeStoreConfig.master_addr must be host:port, got {self.master_addr!r}")
        for name in ("replica_num", "max_entries_per_call", "bounce_bytes", "local_buffer_size",
                     "call_timeout_s", "setup_timeout_s", "close_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MooncakeStoreConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.global_segment_size < 0:
            raise ValueError("MooncakeStoreConfig.global_segment_size must be >= 0")
