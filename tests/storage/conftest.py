"""Storage fixtures: every backend behind one ``backend`` fixture.

``file``: a FileStore in a fresh temporary directory. ``mooncake``: a
MooncakeStore client with no memory of its own, against a real
``mooncake_master`` and a separate ``mooncake_client`` process holding the
pool's memory, so every byte crosses the Store's TCP transport. The master
and the holder are started once per session, bound to 127.0.0.1 on free
ports, and stopped at the end; tests keep apart by using fresh keys.
``nixl``: a NixlStore on NIXL's POSIX backend in a fresh temporary directory
(skipped, with the reason, where NIXL does not import).
"""

from __future__ import annotations

import uuid

import pytest

from transfer.storage.base import open_storage
from transfer.storage.nixl.probe import nixl_missing_reason

from ._mooncake import MooncakeCluster

NIXL_MISSING = nixl_missing_reason()
BACKENDS = ["file", "mooncake",
            pytest.param("nixl", marks=pytest.mark.skipif(bool(NIXL_MISSING), reason=f"nixl backend: {NIXL_MISSING}"))]


@pytest.fixture(scope="session")
def mooncake_cluster(tmp_path_factory):
    cluster = MooncakeCluster(tmp_path_factory.mktemp("mooncake"), holder_bytes=256 << 20)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=BACKENDS)
def backend_url(request, tmp_path):
    """A URL of a fresh store of each backend kind."""
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    if request.param == "nixl":
        return f"nixl://{tmp_path / 'store'}?backend=POSIX&xfer_timeout_s=20"
    return request.getfixturevalue("mooncake_cluster").url + "&call_timeout_s=20"


@pytest.fixture
def backend(backend_url):
    store = open_storage(backend_url)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def make_keys():
    """``make_keys(n)``: n storage keys no other test uses."""
    def make(n: int) -> list[str]:
        return [uuid.uuid4().hex for _ in range(n)]
    return make
