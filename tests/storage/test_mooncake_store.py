"""The Mooncake Store backend beyond the shared contract: overwrites through a
small bounce buffer, batches cut into calls, and a dead or absent master."""

from __future__ import annotations

import ctypes
import random
import time

import pytest

from transfer.errors import StorageClosedError, StorageUnavailableError
from transfer.storage.base import open_storage

from ._mooncake import MooncakeCluster, free_port


def buffers(sizes, seed):
    rng = random.Random(seed)
    return [(ctypes.c_char * n).from_buffer_copy(rng.randbytes(n)) for n in sizes]


def segs(bufs):
    return [(ctypes.addressof(b), len(b)) for b in bufs]


def test_overwrites_go_through_a_small_bounce_buffer_in_small_calls(mooncake_cluster, make_keys):
    keys = make_keys(30)
    # 4 KiB bounce buffer, at most 5 buffers per Store call: every path is cut into many calls,
    # and values of 6 KiB make the bounce buffer grow.
    with open_storage(mooncake_cluster.url, bounce_bytes="4KiB", max_entries_per_call=5) as store:
        first = [buffers([1000, 1000], seed=i) for i in range(30)]
        assert store.put(keys, [segs(b) for b in first]) == [True] * 30
        second = [buffers([2000, 3000, 1000], seed=100 + i) for i in range(30)]
        assert store.put(keys[::2], [segs(b) for b in second[::2]]) == [True] * 15
        assert store.exists(keys) == 30
        for i, key in enumerate(keys):
            want = second[i] if i % 2 == 0 else first[i]
            dst = buffers([len(b) for b in want], seed=999)
            assert store.get_into([key], [segs(dst)]) == [True]
            assert [d.raw for d in dst] == [w.raw for w in want]


def test_an_unreachable_master_fails_open_quickly():
    start = time.monotonic()
    with pytest.raises(StorageUnavailableError, match="unreachable"):
        open_storage(f"mooncake://127.0.0.1:{free_port()}?protocol=tcp")
    assert time.monotonic() - start < 5


def test_unknown_options_and_bad_urls_are_refused():
    with pytest.raises(ValueError, match="unknown option 'segment'"):
        open_storage("mooncake://127.0.0.1:1?segment=1")
    with pytest.raises(ValueError, match="host:port"):
        open_storage("mooncake://127.0.0.1")
    with pytest.raises(ValueError, match="mooncake://"):
        open_storage("mooncake://127.0.0.1:1/path")


def test_a_killed_master_makes_calls_fail_with_a_typed_error_in_bounded_time(tmp_path, make_keys):
    cluster = MooncakeCluster(tmp_path)
    store = None
    try:
        # This client holds the memory itself: no holder process needed.
        store = open_storage(cluster.url, global_segment_size="16MiB", call_timeout_s=2.0, close_timeout_s=2.0)
        keys = make_keys(4)
        src = [buffers([512, 512], seed=i) for i in range(4)]
        assert store.put(keys, [segs(b) for b in src]) == [True] * 4
        assert store.exists(keys) == 4
        cluster.kill_master()

        dst = buffers([512, 512], seed=50)
        calls = [lambda: store.exists(keys), lambda: store.get_into(keys[:1], [segs(dst)]),
                 lambda: store.put(make_keys(1), [segs(src[0])]), lambda: store.exists(keys)]
        for call in calls:
            # Each fails with -900 (RPC_FAIL) at once, or waits for the Store's reconnect (puts: 4.3 s)
            # and times out after call_timeout_s; a call while one is stuck is refused at once.
            start = time.monotonic()
            with pytest.raises(StorageUnavailableError):
                call()
            assert time.monotonic() - start < 2.5
        start = time.monotonic()
        store.close()  # at most close_timeout_s, even behind a stuck call; the rest goes on in the background
        assert time.monotonic() - start < 3.0
        with pytest.raises(StorageClosedError):
            store.exists(keys)
        # The client's own close unmounts its memory, retrying for ~12 s without a master: give it one.
        cluster.start_master()
        assert store.wait_idle(20), "the Store's own close did not return"
    finally:
        if store is not None:
            store.close()
        cluster.stop()
