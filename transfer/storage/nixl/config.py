"""The ``nixl://`` store's configuration (pure: imports neither NIXL nor torch).
The options of a ``nixl://`` URL are these fields."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NixlStoreConfig"]


@dataclass(frozen=True, kw_only=True)
class NixlStoreConfig:
    """``root``: the directory (created if missing). ``backend``: ``POSIX``,
    ``GDS`` or ``GDS_MT``; ``allow_fallback``: POSIX when GDS cannot run.
    ``memory``: ``DRAM`` or ``VRAM`` (GPU ``device_id``), where every segment
    lies. ``max_bytes``: the cap on the files' total size. ``checksum``:
    CRC-32 of host-memory values. ``direct_io``: open files ``O_DIRECT``.
    ``xfer_timeout_s``: the bound on one call's transfers.
    ``max_descs_per_xfer``: descriptors per NIXL transfer (POSIX's I/O pool
    holds 65,536)."""

    root: str
    backend: str = "POSIX"
    allow_fallback: bool = False
    memory: str = "DRAM"
    device_id: int = 0
    max_bytes: int = 64 << 30
    checksum: bool = True
    direct_io: bool = False
    xfer_timeout_s: float = 30.0
    max_descs_per_xfer: int = 16384

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", str(self.backend).upper())
        object.__setattr__(self, "memory", str(self.memory).upper())
        if not self.root:
            raise ValueError("NixlStoreConfig.root must not be empty")
        if self.backend not in ("POSIX", "GDS", "GDS_MT"):
            raise ValueError(f"NixlStoreConfig.backend must be POSIX, GDS or GDS_MT, got {self.backend!r}")
        if self.memory not in ("DRAM", "VRAM"):
            raise ValueError(f"NixlStoreConfig.memory must be DRAM or VRAM, got {self.memory!r}")
        if self.backend == "POSIX" and self.memory == "VRAM":
            raise ValueError("NixlStoreConfig: the POSIX backend cannot reach GPU memory; use backend=GDS")
        for name in ("max_bytes", "xfer_timeout_s", "max_descs_per_xfer"):
            if not getattr(self, name) > 0:
                raise ValueError(f"NixlStoreConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.device_id < 0:
            raise ValueError(f"NixlStoreConfig.device_id must be >= 0, got {self.device_id!r}")
