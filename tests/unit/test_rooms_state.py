"""State pools over the loopback pair: a room's state items (a Mamba-like
slot state, a sliding-window-like paged state) land item for item with the
last chunk, direct and through a fenced decode rank's staging; what differs
between the two sides is refused at the handshake by field name, and a
request whose state lists do not pair fails naming the state."""

import numpy as np
import pytest
import torch

from transfer import KVPoll, KVReceiver, KVSender

from ._rooms import Role, assert_landed, random_pages, wait_until, terminal

# A Mamba-like state: one slot per request, two buffers of different item sizes (conv and SSM state).
MAMBA = ("mamba", "sharded", True, ((8, 3, 16), (8, 2, 8, 4)))
# A sliding-window-like state: pages of its own, K and V buffers; the two sides may count a page more or less.
SWA = ("swa", "sharded", False, ((32, 4, 2, 16), (32, 4, 2, 16)))
STAGED = dict(staging_bytes=1 << 20, stage_part_bytes=64 << 10, stage_below_bytes=16 << 10)


def _run(prefill, decode, room, src, dst, src_states, dst_states, *, chunks=2):
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, room)
    receiver.init(dst, 2, state_indices=dst_states)
    sender = KVSender(prefill.mgr, None, room)
    wait_until(prefill.mgr, lambda: sender.poll() is not KVPoll.Bootstrapping, what="sender out of Bootstrapping")
    sender.init(len(src), 1)
    parts = np.array_split(src, chunks)
    for i, part in enumerate(parts):
        last = i == chunks - 1
        sender.send(part, last=last, state_indices=src_states if last else None)
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    return sender, receiver


@pytest.mark.parametrize("fenced", [False, True], ids=["direct", "fenced"])
def test_state_items_land_item_for_item_with_the_last_chunk(cluster, fenced):
    prefill = cluster.rank(Role.PREFILL, states=(MAMBA, SWA), **STAGED)
    decode = cluster.rank(Role.DECODE, states=(MAMBA, SWA), **{**STAGED, "write_fence": fenced})
    assert decode.mgr.rank.fenced is fenced
    rng = np.random.default_rng(7)
    for room in range(3):
        src, dst = random_pages(rng, 12), random_pages(rng, 12)
        slot_src, slot_dst = [int(rng.integers(0, 8))], [int(rng.integers(0, 8))]
        win_src = rng.permutation(32)[:5]
        win_dst = rng.permutation(32)[:4]  # decode counts one page fewer: the first four pair up
        before = decode.state_bytes(1, range(32))
        sender, receiver = _run(prefill, decode, 60 + room, src, dst, [slot_src, win_src], [slot_dst, win_dst])
        assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success), \
            (sender.stats(), receiver.stats())
        assert_landed(prefill, decode, src, dst)
        assert decode.state_bytes(0, slot_dst) == prefill.state_bytes(0, slot_src)
        assert decode.state_bytes(1, win_dst) == prefill.state_bytes(1, win_src[:4])
        others = sorted(set(range(32)) - set(int(i) for i in win_dst))
        after = decode.state_bytes(1, others)
        assert after == [b"".join(b[i * len(b) // 32:(i + 1) * len(b) // 32] for i in others) for b in before], \
            "a window page decode did not name was written"
        path = "staged" if fenced else "direct"
        moved = sender.stats().bytes
        assert moved.get(("state:mamba", path)) == (3 * 16 + 2 * 8 * 4) * 2, moved
        assert moved.get(("state:swa", path)) == 4 * 2 * 4 * 2 * 16 * 2, moved


def test_a_room_whose_decode_holds_every_page_still_gets_its_state(cluster):
    prefill = cluster.rank(Role.PREFILL, states=(MAMBA,), **STAGED)
    decode = cluster.rank(Role.DECODE, states=(MAMBA,), **STAGED)
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 77)
    receiver.init([3, 4], 2, skip_pages=2, state_indices=[[5]])
    sender = KVSender(prefill.mgr, None, 77)
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(2, 1)
    sender.send([0, 0], last=True, state_indices=[[6]])
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert decode.state_bytes(0, [5]) == prefill.state_bytes(0, [6])


@pytest.mark.parametrize("fenced", [False, True], ids=["direct", "fenced"])
def test_a_windows_freed_positions_are_neither_sent_nor_written(cluster, fenced):
    """vLLM's sliding-window group: both sides list a block per position, -1
    where the window freed it; decode's -1 positions are not moved and their
    items untouched, prefill's extra blocks before decode's window ignored."""
    prefill = cluster.rank(Role.PREFILL, states=(SWA,), **STAGED)
    decode = cluster.rank(Role.DECODE, states=(SWA,), **{**STAGED, "write_fence": fenced})
    rng = np.random.default_rng(11)
    items = rng.permutation(32)
    src_win = [-1, -1] + [int(i) for i in items[:6]]  # prefill freed the first two positions
    dst_win = [-1, -1, -1, -1] + [int(i) for i in items[10:14]]  # decode wants the last four
    before = decode.state_bytes(0, range(32))
    src, dst = random_pages(rng, 8), random_pages(rng, 8)
    sender, receiver = _run(prefill, decode, 90, src, dst, [src_win], [dst_win])
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success), (sender.stats(), receiver.stats())
    assert decode.state_bytes(0, dst_win[4:]) == prefill.state_bytes(0, src_win[4:])
    others = sorted(set(range(32)) - set(dst_win[4:]))
    after = decode.state_bytes(0, others)
    assert after == [b"".join(b[i * len(b) // 32:(i + 1) * len(b) // 32] for i in others) for b in before]
    moved = sender.stats().bytes
    assert moved.get(("state:swa", "staged" if fenced else "direct")) == 4 * 2 * 4 * 2 * 16 * 2, moved


def test_a_position_decode_wants_but_prefill_freed_fails_the_room_naming_it(cluster):
    prefill = cluster.rank(Role.PREFILL, states=(SWA,))
    decode = cluster.rank(Role.DECODE, states=(SWA,), write_fence=False)
    rng = np.random.default_rng(12)
    src, dst = random_pages(rng, 4), random_pages(rng, 4)
    sender, receiver = _run(prefill, decode, 91, src, dst, [[-1, -1, 5, 6]], [[-1, 3, 4, 7]])
    assert sender.poll() is KVPoll.Failed
    with pytest.raises(Exception, match=r"state swa: decode wants item position\(s\) \[1\].*prefill does not hold"):
        sender.failure_exception()
    assert receiver.poll() is KVPoll.Failed


def test_slot_lists_of_different_lengths_fail_the_room_naming_the_state(cluster):
    prefill = cluster.rank(Role.PREFILL, states=(MAMBA,))
    decode = cluster.rank(Role.DECODE, states=(MAMBA,), write_fence=False)
    src, dst = np.arange(4), np.arange(4)
    sender, receiver = _run(prefill, decode, 80, src, dst, [[1, 2]], [[3]], chunks=1)
    assert receiver.poll() is KVPoll.Failed and sender.poll() is KVPoll.Failed
    with pytest.raises(Exception, match=r"state mamba: prefill names 2 item\(s\), decode 1"):
        sender.failure_exception()


def test_a_last_send_without_the_state_decode_asks_for_fails_the_room(cluster):
    prefill = cluster.rank(Role.PREFILL, states=(MAMBA,))
    decode = cluster.rank(Role.DECODE, states=(MAMBA,), write_fence=False)
    sender, receiver = _run(prefill, decode, 81, np.arange(4), np.arange(4), None, [[3]], chunks=1)
    assert sender.poll() is KVPoll.Failed and receiver.poll() is KVPoll.Failed
    with pytest.raises(Exception, match="decode asks for state mamba, but the last send"):
        sender.failure_exception()


def test_state_indices_outside_the_pool_are_refused_at_init(cluster):
    prefill = cluster.rank(Role.PREFILL, states=(MAMBA,))
    decode = cluster.rank(Role.DECODE, states=(MAMBA,))
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 82)
    receiver.init(np.arange(4), 2, state_indices=[[8]])
    assert receiver.poll() is KVPoll.Failed
    with pytest.raises(Exception, match="state mamba: item index outside its 8 items"):
        receiver.failure_exception()


@pytest.mark.parametrize("decode_state, field", [
    (("mamba", "sharded", True, ((8, 3, 16), (8, 2, 8, 8))), r"states\.mamba\[1\]\.item_bytes"),
    (("swa", "sharded", False, ((32, 4, 2, 16), (32, 4, 2, 16))), "incompatible states"),
    (("mamba", "replicated", True, ((8, 3, 16), (8, 2, 8, 4))), r"states\.mamba\.sharding"),
])
def test_state_pools_that_differ_are_refused_at_the_handshake_by_field(cluster, decode_state, field):
    prefill = cluster.rank(Role.PREFILL, states=(MAMBA,))
    decode = cluster.rank(Role.DECODE, states=(decode_state,))
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, 90)
    receiver.init(np.arange(4), 2, state_indices=[[1]])
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="refused")
    with pytest.raises(Exception, match=field):
        receiver.failure_exception()


def test_a_sharded_state_between_different_tp_sizes_is_refused_naming_it(cluster):
    prefills = [cluster.rank(Role.PREFILL, heads=1, total_heads=2, tp_rank=p, tp_size=2, states=(MAMBA,))
                for p in range(2)]
    decode = cluster.rank(Role.DECODE, heads=2, total_heads=2, states=(MAMBA,))
    receiver = KVReceiver(decode.mgr, prefills[0].mgr.config.bootstrap_addr, 91)
    receiver.init(np.arange(4), 2, state_indices=[[1]])
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="refused")
    with pytest.raises(Exception, match=r"states\.mamba\.tp_size.*cannot reslice it: its buffers name no slice axis"):
        receiver.failure_exception()


@pytest.mark.parametrize("fenced", [False, True], ids=["direct", "fenced"])
def test_a_replicated_state_comes_from_one_prefill_rank_at_tp2_to_1(cluster, fenced):
    """An MLA model's indexer-like state is the same on every TP rank: one
    prefill rank sends it (the one that sends the aux row), the other only
    its heads of the KV."""
    dsa = ("dsa", "replicated", False, ((32, 4, 64),))
    prefills = [cluster.rank(Role.PREFILL, heads=1, total_heads=2, tp_rank=p, tp_size=2, states=(dsa,), **STAGED)
                for p in range(2)]
    decode = cluster.rank(Role.DECODE, heads=2, total_heads=2, states=(dsa,), **{**STAGED, "write_fence": fenced})
    items_src, items_dst = [[3, 9, 4]], [[30, 1, 2]]
    receiver = KVReceiver(decode.mgr, prefills[0].mgr.config.bootstrap_addr, 92)
    receiver.init(np.arange(4), 2, state_indices=items_dst)
    senders = [KVSender(p.mgr, None, 92) for p in prefills]
    for p, s in zip(prefills, senders):
        wait_until(p.mgr, lambda s=s: s.poll() is KVPoll.WaitingForInput)
        s.init(4, 1)
        s.send(np.arange(4), last=True, state_indices=items_src)
    wait_until(decode.mgr, lambda: terminal(receiver, *senders), what="room terminal")
    assert receiver.poll() is KVPoll.Success and all(s.poll() is KVPoll.Success for s in senders)
    # each prefill rank's state is random and different here: the one that sent it is the one whose bytes landed
    landed = decode.state_bytes(0, items_dst[0])
    matches = [landed == p.state_bytes(0, items_src[0]) for p in prefills]
    assert matches.count(True) == 1, matches
    path = "staged" if fenced else "direct"
    sent = [s.stats().bytes.get(("state:dsa", path), 0) for s in senders]
    assert sorted(sent) == [0, 3 * 4 * 64 * 2], sent


def _states(tp: int):
    """A sliding-window-like state (pages of 4 tokens x KV heads x 8 dims,
    sliced by heads) and a Mamba-like one (a conv state whose channels are
    three sub-blocks, each split over the ranks on its own, as a GDN layer's
    query/key/value; an SSM state sliced by heads; a per-slot row the same
    on every rank) at TP ``tp``, with their slice axes."""
    heads, conv, ssm_heads = 2 // tp, 16 // tp, 4 // tp
    swa = ("swa", "sharded", False, ((16, 4, heads, 8),), ((heads, 4, ()),))
    mamba = ("mamba", "sharded", True, ((8, conv, 3), (8, ssm_heads, 4, 2), (8, 5)),
             ((conv, 1, (4, 4, 8)), (ssm_heads, 1, ()), None))
    return swa, mamba


def _units(t, item: int, outer: int, dim: int) -> np.ndarray:
    """Item ``item`` of a state tensor as bytes [outer rows, dim units, unit bytes]."""
    b = t[item].contiguous().view(torch.uint8).numpy().reshape(-1)
    return b.reshape(outer, dim, -1)


def _assembled(shards: list, groups) -> np.ndarray:
    """The whole slice axis from each rank's share (rank order), sub-block by sub-block."""
    tp = len(shards)
    out, off = [], [0] * tp
    for g in groups:
        for r in range(tp):
            out.append(shards[r][:, off[r]:off[r] + g // tp])
            off[r] += g // tp
    return np.concatenate(out, axis=1)


def _share(whole: np.ndarray, groups, r: int, tp: int) -> np.ndarray:
    out, off = [], 0
    for g in groups:
        out.append(whole[:, off + r * (g // tp):off + (r + 1) * (g // tp)])
        off += g
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("fenced", [False, True], ids=["direct", "fenced"])
@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_a_sharded_state_is_resliced_between_different_tp_sizes(cluster, prefill_tp, decode_tp, fenced):
    """Between TP 2 and 1 (both ways) each decode rank's state items hold
    its share of every prefill rank's: the window pages' heads, each conv
    sub-block's channels and the SSM heads, assembled as one rank at the
    larger size would hold them; a buffer without a slice axis comes whole
    from the first prefill rank."""
    prefills = [cluster.rank(Role.PREFILL, heads=2 // prefill_tp, total_heads=2, tp_rank=p, tp_size=prefill_tp,
                             states=_states(prefill_tp), **STAGED) for p in range(prefill_tp)]
    decodes = [cluster.rank(Role.DECODE, heads=2 // decode_tp, total_heads=2, tp_rank=d, tp_size=decode_tp,
                            states=_states(decode_tp), **{**STAGED, "write_fence": fenced}) for d in range(decode_tp)]
    room, pages = 95, np.arange(4)
    src_items, dst_items = [[3, 9, 4], [5]], [[7, 0, 2], [6]]
    receivers = [KVReceiver(d.mgr, prefills[0].mgr.config.bootstrap_addr, room) for d in decodes]
    for r in receivers:
        r.init(pages, 2, state_indices=dst_items)
    senders = [KVSender(p.mgr, None, room) for p in prefills]
    for p, s in zip(prefills, senders):
        wait_until(p.mgr, lambda s=s: s.poll() is KVPoll.WaitingForInput)
        s.init(4, 1)
        s.send(pages, last=True, state_indices=src_items)
    wait_until(decodes[0].mgr, lambda: terminal(*receivers, *senders), what="room terminal")
    assert all(x.poll() is KVPoll.Success for x in (*receivers, *senders)), \
        [str(getattr(x, "_state", "")) for x in senders]
    # (state, buffer, slice axis: (outer, groups)) of every sliced buffer; the whole axis from the prefill shares
    sliced = [(0, 0, 4, (2,)), (1, 0, 1, (4, 4, 8)), (1, 1, 1, (4,))]
    for s, b, outer, groups in sliced:
        for src_i, dst_i in zip(src_items[s], dst_items[s]):
            shares = [_units(p.states[s].buffers[b], src_i, outer, sum(groups) // prefill_tp) for p in prefills]
            whole = _assembled(shares, groups)
            for d, dec in enumerate(decodes):
                got = _units(dec.states[s].buffers[b], dst_i, outer, sum(groups) // decode_tp)
                assert np.array_equal(got, _share(whole, groups, d, decode_tp)), (s, b, src_i, d)
    for dec in decodes:  # the row the same on every rank: whole, from the first prefill rank of the decode rank's
        assert dec.state_bytes(1, [6])[2] == prefills[0].state_bytes(1, [5])[2]
