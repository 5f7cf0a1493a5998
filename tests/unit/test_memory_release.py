"""Memory release and resume (SGLang's ``release_memory_occupation`` /
``resume_memory_occupation``, between weight updates in RL loops) over the
loopback pair: a room in flight fails cleanly on both sides and nothing is
written into the released pages afterwards; no room starts while released;
after resume a room lands byte-exact at the same addresses."""

import threading
import time

import numpy as np
import pytest
import torch

from transfer import KVPoll, KVReceiver, KVSender
from transfer.errors import ClosedError, MemoryReleasedError
from transfer.plan import TransferPlan

from ._rooms import Role, assert_landed, random_pages, run_room, transferring, wait_until


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_room_in_flight_fails_and_nothing_lands_after_release(cluster, side):
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE, write_fence=False)
    rng = np.random.default_rng(21)
    src, dst = random_pages(rng, 16), random_pages(rng, 16)
    cluster.fabric.hold_writes()
    sender, receiver = transferring(prefill, decode, 40, src, dst)
    releasing = (decode if side == "decode" else prefill).mgr
    # The held write keeps the release waiting: it must not return while a write may still land.
    with pytest.raises(Exception, match="still had writes in flight"):
        releasing.release_memory(timeout_s=0.3)
    cluster.fabric.release_writes()
    releasing.release_memory(timeout_s=10.0)  # idempotent: returns once the writes ended
    for room in (sender, receiver):
        mgr = prefill.mgr if room is sender else decode.mgr
        wait_until(mgr, lambda: room.poll() is KVPoll.Failed, what=f"{side} release fails the room")
    with pytest.raises(Exception, match="released the KV memory|aborted"):
        (receiver if side == "decode" else sender).failure_exception()
    before = [t.clone() for t in (*decode.k, *decode.v)]
    time.sleep(0.2)
    assert all(bool((a == b).all()) for a, b in zip(before, (*decode.k, *decode.v))), "written after release"
    with pytest.raises(MemoryReleasedError, match="no room starts before resume_memory"):
        (KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 41) if side == "decode"
         else KVSender(prefill.mgr, None, 41))
    assert releasing.memory_released
    releasing.resume_memory()
    assert not releasing.memory_released
    src, dst = random_pages(rng, 12), random_pages(rng, 12)
    sender, receiver = run_room(prefill, decode, 42, src, dst)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert_landed(prefill, decode, src, dst)


def test_released_decode_pools_take_no_write(cluster):
    """An unfenced decode rank's pools are unregistered at release: a write
    into them is refused by the transport, as a peer's late write would be."""
    prefill, decode = cluster.rank(Role.PREFILL), cluster.rank(Role.DECODE, write_fence=False)
    before = list(cluster.fabric.transport_of(decode.mgr.rank.session).regions)
    decode.mgr.release_memory()
    after = cluster.fabric.transport_of(decode.mgr.rank.session).regions
    assert before and not set(before) & set(after), (before, after)
    src, dst = prefill.k[0], decode.k[0]
    plan = TransferPlan(np.asarray([src.data_ptr()], dtype=np.uint64), np.asarray([dst.data_ptr()], dtype=np.uint64),
                        np.asarray([64], dtype=np.uint64))
    done = threading.Event()
    errors = []
    prefill.mgr.transport.submit(decode.mgr.rank.session, plan, lambda e: (errors.append(e), done.set()), None)
    assert done.wait(5) and errors[0] is not None and "outside the memory" in str(errors[0]), errors
    assert int(dst.view(torch.uint8).flatten()[:64].sum()) == 0  # decode's zeros, untouched
    decode.mgr.resume_memory()
    assert set(before) <= set(cluster.fabric.transport_of(decode.mgr.rank.session).regions)


def test_a_closed_manager_refuses_release(cluster):
    prefill = cluster.rank(Role.PREFILL)
    prefill.mgr.close()
    with pytest.raises(ClosedError, match="closed"):
        prefill.mgr.release_memory()
