"""A Mooncake Store cluster on loopback for tests: :class:`LocalMooncake`,
skipping the test (with the reason) where the Store is not installed."""

from __future__ import annotations

import pytest

from harness.local_mooncake import LocalMooncake, free_port, mooncake_missing_reason

__all__ = ["MooncakeCluster", "free_port"]


class MooncakeCluster(LocalMooncake):
    def __init__(self, log_dir, *, holder_bytes: int = 0) -> None:
        reason = mooncake_missing_reason()
        if reason:
            pytest.skip(reason)
        super().__init__(log_dir, holder_bytes=holder_bytes)
