"""The pure parts of kvferry's secondary tier for vLLM's OffloadingConnector:
its options and keys (``tier_keys``), its non-blocking lookup answers
(``tier_lookups``) and its store thread (``tier_thread``) over a real file
store, random bytes compared exactly. Without vLLM; the tier itself against
vLLM's interface is tests/engines/vllm/test_tier.py."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time

import pytest

from transfer.adapters.vllm.tier_keys import DEFAULT_URL, TierOptions, namespace_of, store_key
from transfer.adapters.vllm.tier_lookups import LookupTable
from transfer.adapters.vllm.tier_thread import JobDone, Load, Lookup, LookupDone, Store, StoreThread
from transfer.errors import StorageUnavailableError
from transfer.storage import open_storage
from transfer.storage.base import StorageBackend, check_keys

CHUNK_BYTES = 4096
LAYOUT = {"model_name": "tiny-llama", "dtype": "bfloat16", "tokens_per_hash": 16, "blocks_per_file": 1,
          "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1, "inference_engine": "vllm",
          "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["model.layers.0.self_attn.attn"]}]}


def test_the_tiers_own_parts_and_the_package_load_no_engine():
    """In a fresh interpreter: the tier's pure parts and ``import
    transfer.adapters.vllm`` load neither vLLM nor torch, zmq or Mooncake
    (only ``transfer.adapters.vllm.tier`` needs vLLM)."""
    code = ("import sys, transfer.adapters.vllm, transfer.adapters.vllm.tier_keys, "
            "transfer.adapters.vllm.tier_lookups, transfer.adapters.vllm.tier_thread; "
            "bad = [m for m in ('torch', 'zmq', 'mooncake', 'vllm') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- options and keys ------------------------------------------------------------------

def test_options_default_to_a_file_store_and_name_an_unknown_option():
    assert TierOptions.from_config({}).storage_url == DEFAULT_URL
    with pytest.raises(ValueError, match=r"unknown option\(s\) storage_ur \(known: .*storage_url"):
        TierOptions.from_config({"storage_ur": "file:///x"})
    for bad in ({"storage_url": "/var/cache"}, {"batch_chunks": 0}, {"batch_chunks": True},
                {"locality": "local"}, {"enable_kv_events": "yes"}, {"shutdown_timeout_s": 0}):
        with pytest.raises(ValueError, match="kvferry tier"):
            TierOptions.from_config(bad)


def test_a_namespace_binds_the_model_the_layout_and_the_chunks_size():
    ns = namespace_of(LAYOUT, CHUNK_BYTES)
    assert ns == namespace_of(dict(reversed(list(LAYOUT.items()))), CHUNK_BYTES) and len(ns) == 16
    others = {namespace_of({**LAYOUT, "model_name": "other"}, CHUNK_BYTES),
              namespace_of({**LAYOUT, "dtype": "float16"}, CHUNK_BYTES),
              namespace_of({**LAYOUT, "tp_size": 2}, CHUNK_BYTES),
              namespace_of({**LAYOUT, "kv_cache_groups": []}, CHUNK_BYTES),
              namespace_of(LAYOUT, 2 * CHUNK_BYTES)}
    assert len(others) == 5 and ns not in others
    with pytest.raises(ValueError):
        namespace_of(LAYOUT, 0)


def test_a_store_key_leads_with_the_hash_and_is_a_valid_storage_key():
    ns = namespace_of(LAYOUT, CHUNK_BYTES)
    block_hash = bytes(range(32))  # vLLM's sha256 block hashes: 32 bytes
    key = store_key(ns, block_hash, 3)
    assert key == f"{block_hash.hex()}.g3.{ns}" and len(key) < 200
    check_keys([key])  # the store's own rule
    assert store_key(ns, block_hash, 0) != key != store_key(namespace_of({**LAYOUT, "model_name": "b"}, 4096),
                                                            block_hash, 3)
    with pytest.raises(ValueError):
        store_key(ns, b"", 0)


# --- lookups -----------------------------------------------------------------------------

def test_a_lookup_answers_not_yet_until_the_store_answered():
    table = LookupTable()
    assert table.ask("a", "r1") is None and table.ask("b", "r1") is None
    assert table.ask("a", "r2") is None  # asked again: queued once
    assert table.take_queued() == ["a", "b"] and table.take_queued() == []
    assert table.ask("a", "r1") is None and table.num_waiting == 2  # in flight
    table.answer(["a", "b"], [True, False])
    assert (table.ask("a", "r1"), table.ask("b", "r1"), table.num_waiting) == (True, False, 0)


def test_an_answer_lives_while_a_request_asks_and_in_flight_entries_wait_for_theirs():
    table = LookupTable()
    table.ask("a", "r1")
    table.ask("q", "r1")
    assert table.take_queued() == ["a", "q"]
    table.ask("z", "r1")  # queued, not sent
    table.forget("r1")
    assert len(table) == 2 and table.take_queued() == []  # z dropped from the queue; a and q still in flight
    table.answer(["a", "q"], [True, True])
    assert len(table) == 0  # answered with no request left: dropped
    table.ask("a", "r2")  # asked afresh: a new question, not the old answer
    assert table.take_queued() == ["a"]


def test_what_the_tier_learns_corrects_kept_answers_only():
    table = LookupTable()
    for key in ("a", "b"):
        table.ask(key, "r")
    table.answer(table.take_queued(), [False, True])
    table.ask("c", "r")  # queued
    table.learn(["a", "c"], True)  # a was stored since; c keeps waiting for its own answer
    table.learn(["b"], False)  # b failed to load
    assert (table.ask("a", "r"), table.ask("b", "r"), table.ask("c", "r")) == (True, False, None)


# --- the store thread over a real file store ---------------------------------------------

class Chunks:
    """``n`` chunks of host memory (ctypes), as vLLM's primary CPU tier's rows."""

    def __init__(self, n: int) -> None:
        self.buf = ctypes.create_string_buffer(n * CHUNK_BYTES)
        self.base = ctypes.addressof(self.buf)

    def segment(self, i: int) -> tuple[int, int]:
        return self.base + i * CHUNK_BYTES, CHUNK_BYTES

    def __getitem__(self, i: int) -> bytes:
        return self.buf.raw[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES]

    def fill(self, i: int, data: bytes) -> None:
        ctypes.memmove(self.base + i * CHUNK_BYTES, data, CHUNK_BYTES)


class Watched(StorageBackend):
    """A real store, each call counted; ``gate`` (cleared) holds every call
    until set; ``fail`` makes the named call raise as a failing store does."""

    def __init__(self, inner: StorageBackend) -> None:
        self.inner, self.url = inner, inner.url
        self.calls: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail: set[str] = set()
        self.close_thread: str | None = None

    def _call(self, name: str, *args):
        self.calls.append(name)
        self.entered.set()
        assert self.gate.wait(10), "a test left the gate shut"
        if name in self.fail:
            raise StorageUnavailableError(f"{name} failed (test)")
        return getattr(self.inner, name)(*args)

    def exists(self, keys):
        return self._call("exists", keys)

    def put(self, keys, segments):
        return self._call("put", keys, segments)

    def get_into(self, keys, segments):
        return self._call("get_into", keys, segments)

    def close(self) -> None:
        self.close_thread = threading.current_thread().name
        self.inner.close()


@pytest.fixture
def store(tmp_path):
    watched = Watched(open_storage(f"file://{tmp_path}/store"))
    yield watched
    watched.gate.set()


def results(thread: StoreThread, n: int, timeout_s: float = 10.0) -> list:
    """The next ``n`` results, waiting at most ``timeout_s``."""
    out: list = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += thread.take_results()
        time.sleep(0.005)
    assert len(out) == n, out
    return out


def keys_of(n: int) -> tuple[str, ...]:
    ns = namespace_of(LAYOUT, CHUNK_BYTES)
    return tuple(store_key(ns, os.urandom(32), 0) for _ in range(n))


def test_chunks_stored_and_loaded_into_other_rows_are_the_same_bytes(store):
    chunks, keys = Chunks(8), keys_of(3)
    data = [os.urandom(CHUNK_BYTES) for _ in keys]
    for i, d in enumerate(data):
        chunks.fill(i, d)
    thread = StoreThread(store, batch_keys=2, name="test-tier")  # two calls per batch of 3
    try:
        thread.submit(Store(1, keys, tuple(chunks.segment(i) for i in range(3))))
        (done,) = results(thread, 1)
        assert (done.job_id, done.ok, done.error) == (1, (True, True, True), None) and done.seconds > 0
        for i in range(8):
            chunks.fill(i, bytes(CHUNK_BYTES))
        thread.submit(Load(2, keys, tuple(chunks.segment(i) for i in (7, 5, 6))))
        (done,) = results(thread, 1)
        assert done.ok == (True, True, True) and done.error is None
        assert [chunks[7], chunks[5], chunks[6]] == data and chunks[0] == bytes(CHUNK_BYTES)
    finally:
        assert thread.stop(10)
    assert store.close_thread == "test-tier"  # closed on the store's own thread


def test_a_lookup_answers_each_key_and_a_store_skips_what_is_there(store):
    chunks, keys = Chunks(4), keys_of(4)
    for i in range(4):
        chunks.fill(i, os.urandom(CHUNK_BYTES))
    thread = StoreThread(store, batch_keys=64, name="test-tier")
    try:
        thread.submit(Store(1, keys[::2], (chunks.segment(0), chunks.segment(2))))
        assert results(thread, 1)[0].ok == (True, True)
        thread.submit(Lookup(7, keys))
        assert results(thread, 1) == [LookupDone(7, (True, False, True, False))]
        store.calls.clear()
        thread.submit(Store(2, keys, tuple(chunks.segment(i) for i in range(4))))
        (done,) = results(thread, 1)
        assert done.ok == (True,) * 4 and store.calls.count("put") == 1
    finally:
        thread.stop(10)


def test_a_missing_chunk_fails_alone_and_a_failing_store_fails_the_job_not_the_thread(store):
    chunks, keys = Chunks(4), keys_of(3)
    payload = os.urandom(CHUNK_BYTES)
    chunks.fill(0, payload)
    thread = StoreThread(store, batch_keys=64, name="test-tier")
    try:
        thread.submit(Store(1, keys[:1], (chunks.segment(0),)))
        results(thread, 1)
        thread.submit(Load(2, (keys[0], keys[1]), (chunks.segment(2), chunks.segment(3))))
        (done,) = results(thread, 1)
        assert (done.ok, done.error) == ((True, False), None) and chunks[2] == payload
        store.fail = {"get_into", "exists"}
        thread.submit(Load(3, keys[:1], (chunks.segment(1),)))
        thread.submit(Lookup(4, keys))
        load, lookup = results(thread, 2)
        assert load.ok == (False,) and "StorageUnavailableError: get_into failed" in load.error
        assert lookup.present == (False,) * 3 and "exists failed" in lookup.error
        store.fail = set()
        thread.submit(Lookup(5, keys))  # the thread lives on
        assert results(thread, 1) == [LookupDone(5, (True, False, False))]
    finally:
        thread.stop(10)


def test_submitting_never_waits_for_the_store_and_loads_go_first(store):
    chunks, keys = Chunks(4), keys_of(3)
    thread = StoreThread(store, batch_keys=64, name="test-tier")
    try:
        store.gate.clear()
        thread.submit(Lookup(1, keys[:1]))
        assert store.entered.wait(10)  # the thread is inside the store, held
        started = time.monotonic()
        thread.submit(Store(2, keys[1:2], (chunks.segment(1),)))
        thread.submit(Lookup(3, keys[2:]))
        thread.submit(Load(4, keys[:1], (chunks.segment(0),)))
        assert time.monotonic() - started < 2.0 and thread.take_results() == []  # the gate holds for 10 s
        assert not thread.wait_idle(0.05)
        store.gate.set()
        assert thread.wait_idle(10)
        order = [r.batch_id if isinstance(r, LookupDone) else r.job_id for r in thread.take_results()]
        assert order == [1, 4, 3, 2]  # the held lookup, then the load, the lookup, the store
    finally:
        store.gate.set()
        thread.stop(10)


def test_stop_cancels_what_is_queued_and_is_bounded_by_its_timeout(store):
    chunks, keys = Chunks(2), keys_of(2)
    thread = StoreThread(store, batch_keys=64, name="test-tier")
    store.gate.clear()
    thread.submit(Lookup(1, keys))
    assert store.entered.wait(10)
    thread.submit(Store(2, keys, (chunks.segment(0), chunks.segment(1))))
    started = time.monotonic()
    assert thread.stop(0.2) is False  # the held call still runs
    assert time.monotonic() - started < 2
    assert store.close_thread is None
    (cancelled,) = thread.take_results()
    assert cancelled == JobDone(2, (False, False), 0.0, "the tier is shut down")
    store.gate.set()
    assert thread.stop(10) is True
    assert store.close_thread == "test-tier" and [r.batch_id for r in thread.take_results()] == [1]
    thread.submit(Load(3, keys[:1], (chunks.segment(0),)))  # after stop: answered at once
    assert thread.take_results() == [JobDone(3, (False,), 0.0, "the tier is shut down")]
