"""The producer's ``ready`` event of ``KVSender.send``: nothing reads a
chunk's pages before it completed (direct transport jobs, staged gathers,
the storage write-through), and nothing waits on the scheduler's thread.
The pages are rewritten after ``send()`` and before the event completes:
decode must see the rewritten bytes."""

import threading
import time

import numpy as np
import pytest
import torch

from ._fakecuda import FakeEvent, SyncOnlyEvent
from ._rooms import Role, assert_landed, opened, random_pages, terminal, wait_until
from transfer import KVPoll, KVReceiver, KVSender
from transfer.errors import TransferError
from transfer.ready import ReadyGate, check_event
from transfer.config import EngineConfig
from transfer.transport.mooncake.writes import MooncakeJob, MooncakeWrites

STAGED = dict(staging_bytes=1 << 20, stage_part_bytes=4096, stage_below_bytes=1 << 20)


def _rewrite(rank, pages, seed: int) -> None:
    """New random bytes in ``pages`` of every buffer (the producer's late write)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    for t in (*rank.k, *rank.v):
        raw = torch.randint(0, 256, (len(pages), t[0].numel() * 2), dtype=torch.uint8, generator=gen)
        t.index_copy_(0, idx, raw.view(torch.bfloat16).view(len(pages), *t.shape[1:]))


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_nothing_reads_the_pages_before_the_event_completes(cluster, staged):
    kw = STAGED if staged else {}
    prefill, decode = cluster.rank(Role.PREFILL, **kw), cluster.rank(Role.DECODE, **kw)
    rng = np.random.default_rng(11)
    src, dst = random_pages(rng, 20), random_pages(rng, 20)
    sender, receiver = opened(prefill, decode, 31, src, dst)
    event = FakeEvent()
    raised: list[BaseException] = []

    def send() -> None:
        try:
            sender.send(src, last=True, ready=event)
        except BaseException as exc:
            raised.append(exc)

    sending = threading.Thread(target=send, daemon=True)
    sending.start()
    sending.join(5.0)  # the event completes only below: a send() that waited for it would never return
    assert not sending.is_alive(), "send() waited for the event"
    assert not raised, raised
    time.sleep(0.3)  # a transport that ignored the event would have copied by now
    assert receiver.poll() is KVPoll.Transferring and sender.poll() is KVPoll.Transferring
    _rewrite(prefill, src, seed=5)
    event.complete()
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert_landed(prefill, decode, src, dst)  # the rewritten bytes
    # Polled on kvferry's threads (the scheduler's may ask once, never waits: see the timing above).
    assert event.num_queries >= 2 and event.query_threads - {threading.main_thread().name}
    if staged:
        assert prefill.mgr.transport.num_descriptors < 20  # went as staged parts
        assert "kvferry-ready" in event.query_threads  # the parts waited off the control thread


def test_staged_parts_of_a_late_event_leave_the_control_thread_free(cluster):
    """While a chunk's event is pending, its gathered parts have not asked
    decode for staging, and the control thread keeps serving: a second room
    without an event lands meanwhile."""
    prefill, decode = cluster.rank(Role.PREFILL, **STAGED), cluster.rank(Role.DECODE, **STAGED)
    rng = np.random.default_rng(16)
    pages = rng.permutation(64)
    (src1, src2), (dst1, dst2) = (pages[:12], pages[12:24]), (pages[24:36], pages[36:48])
    s1, r1 = opened(prefill, decode, 41, src1, dst1)
    s2, r2 = opened(prefill, decode, 42, src2, dst2)
    event = FakeEvent()
    s1.send(src1, last=True, ready=event)
    s2.send(src2, last=True)
    wait_until(decode.mgr, lambda: terminal(s2, r2), what="the second room")
    assert (s2.poll(), r2.poll()) == (KVPoll.Success, KVPoll.Success)
    assert r1.poll() is KVPoll.Transferring
    _rewrite(prefill, src1, seed=8)
    event.complete()
    wait_until(decode.mgr, lambda: terminal(s1, r1), what="the first room")
    assert r1.poll() is KVPoll.Success
    assert decode.page_bytes(dst1) == prefill.page_bytes(src1)
    assert decode.page_bytes(dst2) == prefill.page_bytes(src2)


def test_an_event_that_never_completes_fails_the_room_after_transfer_timeout_s(cluster):
    prefill = cluster.rank(Role.PREFILL, transfer_timeout_s=0.5)
    decode = cluster.rank(Role.DECODE)
    rng = np.random.default_rng(12)
    src, dst = random_pages(rng, 4), random_pages(rng, 4)
    sender, receiver = opened(prefill, decode, 32, src, dst)
    sender.send(src, last=True, ready=FakeEvent())
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.Failed, what="sender failed")
    with pytest.raises(TransferError, match="ready event .* did not complete within 0.5 s"):
        sender.failure_exception()
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="receiver failed")


def test_an_event_without_query_is_synchronised_on_the_worker(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(13)
    src, dst = random_pages(rng, 6), random_pages(rng, 6)
    sender, receiver = opened(prefill, decode, 33, src, dst)
    event = SyncOnlyEvent()
    sender.send(src, last=True, ready=event)
    _rewrite(prefill, src, seed=6)
    event.complete()
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    assert receiver.poll() is KVPoll.Success
    assert_landed(prefill, decode, src, dst)
    assert event.threads and threading.current_thread().name not in event.threads


def test_a_ready_that_cannot_say_it_completed_is_a_type_error(cluster):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE)
    rng = np.random.default_rng(14)
    src, dst = random_pages(rng, 2), random_pages(rng, 2)
    sender, _ = opened(prefill, decode, 34, src, dst)
    with pytest.raises(TypeError, match="torch.cuda.Event"):
        sender.send(src, last=True, ready=object())
    with pytest.raises(TypeError):
        check_event(3)
    check_event(None)


def test_the_write_through_waits_for_the_event(cluster, tmp_path):
    storage = dict(storage_url=f"file://{tmp_path}", model_name="m")
    prefill, decode = cluster.rank(Role.PREFILL, **storage), cluster.rank(Role.DECODE)
    tokens = np.arange(4 * 6, dtype=np.int64)  # 6 full pages of 4 tokens
    rng = np.random.default_rng(15)
    src, dst = random_pages(rng, 6), random_pages(rng, 6)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 35)
    receiver.init(dst, 2)
    sender = KVSender(prefill.mgr, None, 35)
    wait_until(prefill.mgr, lambda: sender.poll() is not KVPoll.Bootstrapping, what="sender ready")
    sender.init(len(src), 1, token_ids=tokens)
    event = FakeEvent()
    sender.send(src, last=True, ready=event)
    _rewrite(prefill, src, seed=7)
    event.complete()
    wait_until(prefill.mgr, lambda: terminal(sender, receiver), what="room terminal")
    assert sender.poll() is KVPoll.Success
    tier = prefill.mgr.storage
    wait_until(prefill.mgr, lambda: tier.num_pages_written == 6, what="pages written through")
    # What storage holds is the rewritten KV: read it back into fresh pages of the prefill pool.
    fresh = np.setdiff1d(np.arange(64), src)[:6]
    done = threading.Event()
    from bootstrap.messages import PoolRole
    keys = tier.keys(PoolRole.TARGET, tier.chains(tokens))
    tier.read({PoolRole.TARGET: (keys, fresh.tolist())}, None, lambda job: done.set())
    assert done.wait(10)
    assert prefill.page_bytes(fresh) == prefill.page_bytes(src)


# --- the Mooncake worker's gating, with a fake engine ----------------------------


class _Engine:
    def __init__(self) -> None:
        self.writes: list[int] = []

    def transfer_submit_write(self, peer, src, dst, n):
        self.writes.append(src)
        return len(self.writes)

    def transfer_check_status(self, tid):
        return 1


def _transport(engine) -> MooncakeWrites:
    """The Mooncake transport's side of the worker's loop around a fake
    engine, without a worker thread: the test steps it (admit, step) itself."""
    return MooncakeWrites(engine, EngineConfig(protocol="tcp", max_inflight_per_peer=64))


def test_the_mooncake_worker_submits_a_gated_job_only_once_its_event_completed():
    engine, results = _Engine(), []
    t = _transport(engine)
    event = FakeEvent()
    gated = MooncakeJob("peer", [0x1000, 0x2000], [0x9000, 0xA000], [8, 8], results.append,
                        ready=ReadyGate(event, 10.0, "room 1"))
    after = MooncakeJob("peer", [0x3000], [0xB000], [8], results.append)  # another room's job to the same peer
    t.admit(gated)
    t.admit(after)
    assert t.step(True) == (0, True)  # the gated job is still held
    assert engine.writes == [0x3000] and event.num_queries >= 1  # the late event holds back its job only
    assert results == [None]
    t.step(True)
    assert engine.writes == [0x3000] and results == [None]
    event.complete()
    assert t.step(True) == (0, False)
    assert engine.writes == [0x3000, 0x1000, 0x2000] and results == [None, None]


def test_the_mooncake_worker_fails_a_job_whose_event_is_late():
    engine, results = _Engine(), []
    t = _transport(engine)
    job = MooncakeJob("peer", [0x1000], [0x9000], [8], results.append, ready=ReadyGate(FakeEvent(), 0.0, "room 2"))
    time.sleep(0.01)
    t.admit(job)
    t.step(True)
    assert engine.writes == []
    assert len(results) == 1 and isinstance(results[0], TransferError)
    assert "did not complete within 0 s" in str(results[0])



def test_an_abort_while_parts_wait_for_their_event_fails_both_sides_at_once(cluster):
    """The scheduler drops the request while its staged parts still wait for
    their event: nothing will read them now, so both sides fail at once
    (not when the event's deadline passes, 10 s here) and every staging
    region is free."""
    prefill, decode = cluster.rank(Role.PREFILL, **STAGED), cluster.rank(Role.DECODE, **STAGED, write_fence=True)
    rng = np.random.default_rng(19)
    src, dst = random_pages(rng, 40), random_pages(rng, 40)
    sender, receiver = opened(prefill, decode, 54, src, dst)
    event = FakeEvent()
    sender.send(src, last=True, ready=event)
    wait_until(prefill.mgr, lambda: event.num_queries > 0, what="the event polled")
    sender.abort("the scheduler dropped the request mid-forward")
    wait_until(decode.mgr, lambda: terminal(sender, receiver), timeout_s=5, what="room terminal")
    assert (sender.poll(), receiver.poll()) == (KVPoll.Failed, KVPoll.Failed)
    for rank in (prefill, decode):
        area = rank.mgr.context.staging.area
        wait_until(rank.mgr, lambda: area.free_bytes == area.nbytes, timeout_s=5, what="staging free")
    event.complete()  # late: nothing of the failed room is read or written
    time.sleep(0.3)
    assert decode.page_bytes(dst) == [bytes(len(b)) for b in decode.page_bytes(dst)]
