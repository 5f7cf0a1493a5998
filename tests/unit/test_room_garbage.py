"""A room leaves no garbage that only a collection frees (issue 40 item 4).

A room whose objects reference each other in a cycle is freed by a garbage
collection, not by its last reference: every room then adds to the count
that starts the next collection, and a collection stops every thread of the
process, the scheduler's included, for as long as it walks the heap (a
process that has not frozen its start-up heap: milliseconds). So rooms of
every kind, ended every way, must be freed by reference counting alone.

Each case runs its rooms with the collector off, then collects with
``gc.DEBUG_SAVEALL`` (what a collection would have freed stays in
``gc.garbage``) and names what it found. The rooms are checked byte for
byte, or checked failed, before the count. The loopback pair carries the
bytes (a fake of the transport); every transport ends its jobs through
``end_job``, whose letting go of the callback is tested beside it
(tests/unit/test_transport_choice.py)."""

from __future__ import annotations

import collections
import gc

import numpy as np
import pytest

from transfer import KVPoll, KVReceiver, KVSender, Role

from ._rooms import assert_landed, random_pages, run_room, terminal, wait_until

STAGED = dict(staging_bytes=1 << 20, stage_part_bytes=4096, stage_below_bytes=1 << 20, write_fence=False)
ROOMS = 6


def _collected_garbage() -> collections.Counter:
    """What a collection now finds unreachable, by type (module.name)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


def _without_collector(run) -> dict:
    """The garbage left by ``run()`` (the collector off meanwhile), by type,
    the most frequent first."""
    gc.collect()
    gc.disable()
    try:
        run()
        return dict(_collected_garbage().most_common())
    finally:
        gc.enable()


def _succeeding(prefill, decode, rng, first_room: int):
    def run():
        for room in range(first_room, first_room + ROOMS):
            src, dst = random_pages(rng, 8), random_pages(rng, 8)
            sender, receiver = run_room(prefill, decode, room, src, dst)
            assert sender.poll() is KVPoll.Success and receiver.poll() is KVPoll.Success
            assert_landed(prefill, decode, src, dst)
    return run


@pytest.mark.parametrize("path", [{}, STAGED], ids=["direct", "staged"])
def test_rooms_that_succeed_leave_no_garbage(cluster, path):
    prefill, decode = cluster.rank(Role.PREFILL, **path), cluster.rank(Role.DECODE, **path)
    rng = np.random.default_rng(7)
    _succeeding(prefill, decode, rng, 100)()  # the rank's own first-contact objects, made once
    assert _without_collector(_succeeding(prefill, decode, rng, 200)) == {}


def test_rooms_that_fail_leave_no_garbage(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(8)
    _succeeding(prefill, decode, rng, 100)()

    def run():
        for room in range(300, 300 + ROOMS):
            src, dst = random_pages(rng, 8), random_pages(rng, 8)
            receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, room)
            receiver.init(dst, 2)
            sender = KVSender(prefill.mgr, None, room)
            wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.WaitingForInput, what="WaitingForInput")
            sender.init(len(src), 1)
            if room % 2:  # aborted by decode's scheduler, then by prefill's for the other half
                receiver.abort()
            else:
                sender.abort()
            wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
            assert sender.poll() is KVPoll.Failed and receiver.poll() is KVPoll.Failed
    assert _without_collector(run) == {}


def test_rooms_through_storage_leave_no_garbage(cluster, tmp_path):
    """Written through on prefill; on decode, prefetched, and restored after
    the transfer failed."""
    store = dict(storage_url=f"file://{tmp_path / 'kv'}", model_name="test-model")
    prefill = cluster.rank(Role.PREFILL, **store)
    decode = cluster.rank(Role.DECODE, storage_prefetch="wait_complete", **store)
    restoring = cluster.rank(Role.DECODE, storage_prefetch="off", **store)  # every write to it fails
    cluster.fabric.break_writes(restoring.mgr.rank.session)
    rng = np.random.default_rng(9)
    num_pages = 6
    prompts = [rng.integers(0, 50000, num_pages * 4) for _ in range(ROOMS)]
    sources = [random_pages(rng, num_pages) for _ in range(ROOMS)]
    sender, receiver = run_room(prefill, decode, 100, sources[0], random_pages(rng, num_pages), token_ids=prompts[0])
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)

    def run():
        for i in range(1, ROOMS):  # written through by prefill
            sender, receiver = run_room(prefill, decode, 400 + i, sources[i], random_pages(rng, num_pages),
                                        token_ids=prompts[i])
            assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
        for i in range(ROOMS):  # prefetched whole: prefill sends nothing
            dst = random_pages(rng, num_pages)
            sender, receiver = run_room(prefill, decode, 500 + i, sources[i], dst, token_ids=prompts[i])
            assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
            assert receiver.pages_from_storage == num_pages
            assert_landed(prefill, decode, sources[i], dst)
        for i in range(ROOMS):  # prefill's writes fail: restored from storage
            dst = random_pages(rng, num_pages)
            sender, receiver = run_room(prefill, restoring, 600 + i, sources[i], dst, token_ids=prompts[i])
            assert (sender.poll(), receiver.poll()) == (KVPoll.Failed, KVPoll.Success)
            assert receiver.pages_from_storage == num_pages
            assert restoring.page_bytes(dst) == prefill.page_bytes(sources[i])
    assert _without_collector(run) == {}
