"""What schedulers like SGLang's need of the room layer, in one process over
the loopback pair: a decode prefix (``KVReceiver.init(skip_pages=)``, read by
prefill as ``KVSender.decode_prefix_pages``), alone and with a storage
prefetch; several aux regions per request slot, byte-exact, through storage
too, and refused naming the region when they differ; the prefill topology
query."""

import threading
import time

import numpy as np
import pytest
import torch

from transfer import BootstrapUnavailable, IncompatibleLayoutError, KVPoll, KVReceiver, KVSender, StateError

from ._rooms import AUX_SLOTS, Role, assert_landed, random_pages, run_room, wait_until

SENTINEL = 0x5A


def _hold(rank, pages) -> list[bytes]:
    """Fill decode's held pages with a sentinel; returns their bytes."""
    idx = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    for t in (*rank.k, *rank.v):
        t.view(torch.uint8)[idx] = SENTINEL
    return rank.page_bytes(pages)


def _prefix_room(prefill, decode, room, src, dst, held, *, token_ids=None, chunks=3):
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, room)
    receiver.init(dst, 2, token_ids=token_ids, skip_pages=held)
    sender = KVSender(prefill.mgr, None, room)
    wait_until(prefill.mgr, lambda: sender.poll() is not KVPoll.Bootstrapping, what="requests arrived")
    assert sender.decode_prefix_pages == held
    sender.init(len(src), 1, token_ids=token_ids)
    for i, part in enumerate(np.array_split(src, chunks)):
        sender.send(part, last=i == chunks - 1)
    wait_until(decode.mgr, lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed) and
               receiver.poll() in (KVPoll.Success, KVPoll.Failed), what="room terminal")
    return sender, receiver


def test_a_decode_prefix_is_neither_sent_nor_written(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(21)
    num_pages, held = 11, 4
    src, dst = random_pages(rng, num_pages), random_pages(rng, num_pages)
    before = _hold(decode, dst[:held])
    sender, receiver = _prefix_room(prefill, decode, 60, src, dst, held)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success), receiver.failure_exception()
    assert decode.page_bytes(dst[:held]) == before  # decode's own pages: untouched
    assert_landed(prefill, decode, src[held:], dst[held:])


def test_skip_pages_outside_the_request_fail_the_room(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 61)
    receiver.init(random_pages(np.random.default_rng(22), 3), 2, skip_pages=4)
    assert receiver.poll() is KVPoll.Failed
    with pytest.raises(ValueError, match="skip_pages 4 outside the request's 3 pages"):
        receiver.failure_exception()


def test_a_prefix_and_a_storage_prefetch_skip_the_larger_end(cluster, tmp_path):
    """Decode holds 4 pages and storage has all 12: the prefetch loads pages
    4..12 (not decode's own), prefill sends none of them, and still reads
    decode's prefix as 4 pages."""
    store = dict(storage_url=f"file://{tmp_path / 'kv'}", model_name="test-model")
    prefill = cluster.rank(Role.PREFILL, **store)
    decode = cluster.rank(Role.DECODE, storage_prefetch="wait_complete", **store)
    rng = np.random.default_rng(23)
    num_pages, held = 12, 4
    tokens = rng.integers(0, 50000, num_pages * 4)
    src = random_pages(rng, num_pages)
    sender, receiver = run_room(prefill, decode, 62, src, random_pages(rng, num_pages), token_ids=tokens)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    stored = prefill.page_bytes(src)
    # Prefill's pages change: any page it sent now would differ from storage's.
    for t in (*prefill.k, *prefill.v):
        t.view(torch.uint8)[torch.as_tensor(src)] = 0
    dst = random_pages(rng, num_pages)
    for t in (*decode.k, *decode.v):
        t.zero_()
    before = _hold(decode, dst[:held])
    sender2, receiver2 = _prefix_room(prefill, decode, 63, src, dst, held, token_ids=tokens)
    assert (sender2.poll(), receiver2.poll()) == (KVPoll.Success, KVPoll.Success), receiver2.failure_exception()
    assert receiver2.pages_from_storage == num_pages - held
    assert [r.skip_pages for r in sender2.requests] == [num_pages]
    assert decode.page_bytes(dst[:held]) == before
    whole = decode.page_bytes(dst)
    page_bytes = [len(b) // num_pages for b in stored]
    assert [b[held * n:] for b, n in zip(whole, page_bytes)] == [b[held * n:] for b, n in zip(stored, page_bytes)]
    assert decode.aux_bytes(2) == prefill.aux_bytes(1)


def test_decode_ranks_that_hold_different_prefixes_are_an_error(cluster):
    prefill = cluster.rank(Role.PREFILL, heads=2, total_heads=2)
    decodes = [cluster.rank(Role.DECODE, heads=1, total_heads=2, tp_rank=d, tp_size=2) for d in range(2)]
    rng = np.random.default_rng(24)
    for d, decode in enumerate(decodes):
        KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 64).init(random_pages(rng, 6), 2, skip_pages=d + 1)
    sender = KVSender(prefill.mgr, None, 64)
    with pytest.raises(StateError, match="before every decode request arrived"):
        _ = sender.decode_prefix_pages
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.WaitingForInput, what="both requests arrived")
    with pytest.raises(StateError, match="decode ranks hold different prefixes: rank 0 1 pages, rank 1 2 pages"):
        _ = sender.decode_prefix_pages


def test_several_aux_regions_land_byte_exact(cluster):
    rows = (64, 8, 520, 4)
    prefill = cluster.rank(Role.PREFILL, aux_row_bytes=rows)
    decode = cluster.rank(Role.DECODE, aux_row_bytes=rows)
    assert [a.slot_bytes for a in prefill.mgr.rank.aux] == list(rows)
    rng = np.random.default_rng(25)
    src, dst = random_pages(rng, 7), random_pages(rng, 7)
    sender, receiver = run_room(prefill, decode, 65, src, dst, src_aux=5, dst_aux=2)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success), receiver.failure_exception()
    assert_landed(prefill, decode, src, dst, src_aux=5, dst_aux=2)
    assert all(not region[s].any() for region in decode.aux for s in range(AUX_SLOTS) if s != 2)


def test_several_aux_regions_are_restored_from_storage(cluster, tmp_path):
    store = dict(storage_url=f"file://{tmp_path / 'kv'}", model_name="test-model")
    rows = (16, 40, 8)
    prefill = cluster.rank(Role.PREFILL, aux_row_bytes=rows, **store)
    decode = cluster.rank(Role.DECODE, aux_row_bytes=rows, storage_prefetch="off", **store)
    rng = np.random.default_rng(26)
    num_pages = 6
    tokens = rng.integers(0, 50000, num_pages * 4)
    src = random_pages(rng, num_pages)
    run_room(prefill, decode, 66, src, random_pages(rng, num_pages), token_ids=tokens)
    cluster.fabric.break_writes(decode.mgr.rank.session)
    dst = random_pages(rng, num_pages)
    for t in (*decode.k, *decode.v, *decode.aux):
        t.zero_()
    sender, receiver = run_room(prefill, decode, 67, src, dst, dst_aux=3, token_ids=tokens)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Failed, KVPoll.Success)
    assert receiver.pages_from_storage == num_pages
    assert_landed(prefill, decode, src, dst, dst_aux=3)


@pytest.mark.parametrize("decode_rows, field", [((64, 16, 8), "aux[1].slot_bytes"), ((64, 24), "aux.num_regions")])
def test_mismatched_aux_regions_are_refused_naming_the_region(cluster, decode_rows, field):
    prefill = cluster.rank(Role.PREFILL, aux_row_bytes=(64, 24, 8))
    decode = cluster.rank(Role.DECODE, aux_row_bytes=decode_rows)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 68)
    receiver.init(random_pages(np.random.default_rng(27), 3), 2)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="handshake refused")
    with pytest.raises(IncompatibleLayoutError) as info:
        receiver.failure_exception()
    assert info.value.field == field
    assert field in str(info.value)


def test_prefill_topology_is_a_bounded_bootstrap_lookup(cluster):
    prefills = [cluster.rank(Role.PREFILL, heads=1, total_heads=2, tp_rank=p, tp_size=2, dp_rank=1, dp_size=2)
                for p in range(2)]
    decode = cluster.rank(Role.DECODE)
    addr = prefills[0].mgr.config.bootstrap_addr
    assert decode.mgr.prefill_topology(addr, "prefill") is None  # DP group 0 not registered
    group0 = [cluster.rank(Role.PREFILL, heads=1, total_heads=2, tp_rank=p, tp_size=2, dp_rank=0, dp_size=2)
              for p in range(2)]
    assert group0 and decode.mgr.prefill_topology(addr, "prefill") == (2, 2)
    assert decode.mgr.prefill_topology(addr, "no-such-node") is None
    with pytest.raises(BootstrapUnavailable):
        decode.mgr.prefill_topology("127.0.0.1:1", "prefill", timeout_s=0.5)


def test_several_aux_regions_reach_a_fenced_decode_rank_in_room_status(cluster):
    """With the write fence, decode's aux memory is not writable: every
    region's row travels in RoomStatus and lands byte-exact."""
    rows = (64, 8, 520)
    staged = dict(staging_bytes=1 << 20, stage_part_bytes=64 << 10, stage_below_bytes=16 << 10)
    prefill = cluster.rank(Role.PREFILL, aux_row_bytes=rows, **staged)
    decode = cluster.rank(Role.DECODE, aux_row_bytes=rows, **staged)
    assert decode.mgr.rank.fenced
    rng = np.random.default_rng(28)
    src, dst = random_pages(rng, 9), random_pages(rng, 9)
    sender, receiver = run_room(prefill, decode, 69, src, dst, chunks=2, src_aux=6, dst_aux=1)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success), receiver.failure_exception()
    assert_landed(prefill, decode, src, dst, src_aux=6, dst_aux=1)
    assert all(not region[s].any() for region in decode.aux for s in range(AUX_SLOTS) if s != 1)


@pytest.mark.parametrize("aux", [None, 2], ids=["no-aux", "aux"])
def test_a_decode_that_holds_every_page_still_ends_the_room(cluster, aux):
    """Decode holds all the request's pages (its prefix cache, or a storage
    prefetch that found them all): prefill's last chunk has nothing to write
    (nothing but the aux row, with one); both sides still end in Success."""
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(23)
    src, dst = random_pages(rng, 3), random_pages(rng, 3)
    before = _hold(decode, dst)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 62 + (aux or 0))
    receiver.init(dst, aux, skip_pages=3)
    sender = KVSender(prefill.mgr, None, 62 + (aux or 0))
    wait_until(prefill.mgr, lambda: sender.poll() is not KVPoll.Bootstrapping, what="requests arrived")
    sender.init(3, None if aux is None else 1)
    sender.send(src, last=True)
    wait_until(decode.mgr, lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed) and
               receiver.poll() in (KVPoll.Success, KVPoll.Failed), what="room terminal", timeout_s=10)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success), receiver.failure_exception()
    assert decode.page_bytes(dst) == before


def test_a_room_failing_during_its_storage_prefetch_waits_for_the_batch_in_progress(cluster, tmp_path):
    """A decode room aborted while the storage tier loads its pages: the
    batch being loaded still writes them, so the room reports Failed (and
    its pages may be reused) only once that batch ended."""
    store = dict(storage_url=f"file://{tmp_path / 'kv'}", model_name="test-model")
    prefill = cluster.rank(Role.PREFILL, **store)
    decode = cluster.rank(Role.DECODE, storage_prefetch="wait_complete", **store)
    rng = np.random.default_rng(25)
    num_pages = 8
    tokens = rng.integers(0, 50000, num_pages * 4)
    src = random_pages(rng, num_pages)
    sender, receiver = run_room(prefill, decode, 65, src, random_pages(rng, num_pages), token_ids=tokens)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    backend = decode.mgr.storage.backend
    loading, release = threading.Event(), threading.Event()
    real_get_into = backend.get_into

    def held_get_into(keys, segments):
        loading.set()
        release.wait(10)
        return real_get_into(keys, segments)

    backend.get_into = held_get_into
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 66)
    receiver.init(random_pages(rng, num_pages), 2, token_ids=tokens)
    assert loading.wait(5), "the prefetch never started"
    receiver.abort()
    time.sleep(0.2)
    assert receiver.poll() is KVPoll.Transferring, "Failed while a storage batch may still write the pages"
    assert not receiver.released()
    release.set()
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="failed once the batch ended")
    assert receiver.released()
