"""Layer-wise sends over the loopback pair (transfer.rooms.layer_groups): a
chunk sent as layer groups, in any order, target and draft layers alike;
the layers of a group land while the chunk's other layers are still to come
(direct path), or, for a fenced decode rank, in the region of its staging
it granted with the request or in one each group's share of a part asked
for, from where it scatters them at once;
decode reaches Success only when every layer of every page landed; a group
that does not fit its chunk is refused by name; an abort mid-stream fails
both sides."""

import time

import numpy as np
import pytest

from transfer import KVPoll, KVReceiver, KVSender
from transfer.errors import StateError

from ._rooms import NUM_LAYERS, Role, assert_landed, opened, random_pages, terminal, wait_until

STAGED = dict(staging_bytes=1 << 20, stage_part_bytes=64 << 10, stage_below_bytes=0)
DRAFT = 1
LAYERS = NUM_LAYERS + DRAFT  # the room's layers: the target's, then the draft's


def _layer_bytes(rank, pages, layer: int) -> list[bytes]:
    """K and V bytes of room layer ``layer`` (target layers, then draft) of ``pages``."""
    every = rank.page_bytes(pages)  # target K..., target V..., draft K..., draft V...
    if layer < NUM_LAYERS:
        return [every[layer], every[NUM_LAYERS + layer]]
    d = layer - NUM_LAYERS
    return [every[2 * NUM_LAYERS + d], every[2 * NUM_LAYERS + DRAFT + d]]


# prefill's parts: written from the pools ("pools"), or gathered into its staging first
GATHER = dict(stage_below_bytes=1 << 30)


@pytest.mark.parametrize("fenced,prefill_cfg,decode_cfg", [
    (False, {}, {}), (True, {}, {}), (True, GATHER, {}), (False, GATHER, GATHER)],
    ids=["direct", "fenced", "fenced-gathered", "unfenced-staged"])
def test_layer_groups_in_any_order_land_every_layer_and_the_room_ends_with_the_last(cluster, fenced, prefill_cfg,
                                                                                    decode_cfg):
    """Unfenced-staged: both sides have staging and the descriptors count as
    small (``stage_below_bytes``), so the shares go through regions decode
    grants part by part, as they do for a fenced rank without room."""
    prefill = cluster.rank(Role.PREFILL, draft_layers=DRAFT, **{**STAGED, **prefill_cfg})
    decode = cluster.rank(Role.DECODE, draft_layers=DRAFT, **{**STAGED, **decode_cfg, "write_fence": fenced})
    staged = fenced or bool(decode_cfg)
    rng = np.random.default_rng(21)
    src, dst = random_pages(rng, 12), random_pages(rng, 12)
    sender, receiver = opened(prefill, decode, 40, src, dst)
    chunks = np.array_split(np.arange(12), 2)
    for c, idx in enumerate(chunks):
        last = c == len(chunks) - 1
        order = [[2], [0], [1]] if c == 0 else [[1, 2], [0]]
        for g, group in enumerate(order):
            sender.send(src[idx], last=last, layers=group)
            if g == 0:  # streamed (fenced: through staging): this group's layers land before the chunk is complete
                wait_until(decode.mgr, lambda: _layer_bytes(decode, dst[idx], group[0])
                           == _layer_bytes(prefill, src[idx], group[0]), what="the first group's layer landed")
                other = min(set(range(LAYERS)) - set(group))  # not sent yet: nothing of it on decode
                assert _layer_bytes(decode, dst[idx], other) == [bytes(len(b)) for b in _layer_bytes(decode, dst[idx], other)]
            if g < len(order) - 1 or not last:
                assert receiver.poll() is not KVPoll.Success and sender.poll() is not KVPoll.Success
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success), (sender.stats(), receiver.stats())
    assert_landed(prefill, decode, src, dst)
    total = sum(len(b) for b in prefill.page_bytes(src))
    for side in (sender, receiver):  # each layer of each page counted once, on the path it took
        moved = side.stats().bytes
        assert {(pool, path): n for (pool, path), n in moved.items() if pool in ("target", "draft")} == \
            {(pool, "staged" if staged else "direct"): total * w for pool, w in (("target", 2 / 3), ("draft", 1 / 3))}, \
            moved


def _staged(rank) -> bytes:
    return rank.mgr.staging.numpy().tobytes()


@pytest.mark.parametrize("prefill_cfg", [{}, GATHER], ids=["pools", "gathered"])
def test_a_fenced_decode_rank_without_room_for_the_request_streams_part_by_part(cluster, prefill_cfg):
    """Decode's staging cannot hold the room's region (its arena is smaller
    than the room): each group's share of each part asks for a region of its
    own size, lands packed in it and is scattered from there (the region
    freed at once), the shares decode has no room for yet wait for regions
    to come free, every byte lands, and decode's staging is all free
    afterwards."""
    prefill = cluster.rank(Role.PREFILL, draft_layers=DRAFT, **{**STAGED, **prefill_cfg})
    decode = cluster.rank(Role.DECODE, draft_layers=DRAFT, staging_bytes=8 << 10, stage_part_bytes=4 << 10,
                          stage_below_bytes=0, write_fence=True)
    rng = np.random.default_rng(25)
    src, dst = random_pages(rng, 12), random_pages(rng, 12)
    assert sum(len(b) for b in prefill.page_bytes(src)) > 8 << 10  # more than decode's staging
    area = decode.mgr.context.staging.area
    sender, receiver = opened(prefill, decode, 45, src, dst)
    sender.send(src, last=True, layers=[0])
    # layer 0 lands while the other groups are still to come
    wait_until(decode.mgr, lambda: _layer_bytes(decode, dst[:1], 0) == _layer_bytes(prefill, src[:1], 0),
               what="the first part's layer 0 landed")
    assert _layer_bytes(decode, dst, 1) == [bytes(len(b)) for b in _layer_bytes(decode, dst, 1)]
    assert receiver.poll() is not KVPoll.Success
    sender.send(src, last=True, layers=[2])
    sender.send(src, last=True, layers=[1])
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success), (sender.stats(), receiver.stats())
    assert_landed(prefill, decode, src, dst)
    # each group (one layer: a third of a page's bytes) in shares of about a part (4 KiB): 8 + 4 pages, not 6 x 2
    assert receiver.stats().num_parts == 3 * 2
    assert area.free_bytes == area.nbytes, "a part's region was not freed"


def test_a_group_that_does_not_fit_its_chunk_is_refused_by_name(cluster):
    prefill = cluster.rank(Role.PREFILL, draft_layers=DRAFT)
    decode = cluster.rank(Role.DECODE, draft_layers=DRAFT, write_fence=False)
    rng = np.random.default_rng(22)
    src, dst = random_pages(rng, 8), random_pages(rng, 8)
    sender, receiver = opened(prefill, decode, 41, src, dst)
    with pytest.raises(StateError, match="outside the room's 3 layers"):
        sender.send(src[:4], layers=[3])
    sender.send(src[:4], layers=range(0, 2))
    with pytest.raises(StateError, match=r"layer\(s\) \[1\] of this chunk were sent already"):
        sender.send(src[:4], layers=[1, 2])
    with pytest.raises(StateError, match="names other pages"):
        sender.send(src[4:], layers=[2])
    with pytest.raises(StateError, match="last=True, its chunk's first group last=False"):
        sender.send(src[:4], last=True, layers=[2])
    with pytest.raises(StateError, match=r"whole chunk while the chunk at page 0 still lacks layer\(s\) \[2\]"):
        sender.send(src[4:], last=True)
    sender.send(src[:4], layers=[2])  # the chunk is complete: the next one starts at page 4
    sender.send(src[4:], last=True)
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert_landed(prefill, decode, src, dst)


def test_an_abort_mid_stream_fails_both_sides(cluster):
    prefill = cluster.rank(Role.PREFILL)
    decode = cluster.rank(Role.DECODE, write_fence=False)
    rng = np.random.default_rng(23)
    src, dst = random_pages(rng, 6), random_pages(rng, 6)
    sender, receiver = opened(prefill, decode, 42, src, dst)
    sender.send(src, last=True, layers=[0])
    sender.abort("the scheduler dropped the request mid-forward")
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    assert (sender.poll(), receiver.poll()) == (KVPoll.Failed, KVPoll.Failed)
    with pytest.raises(Exception, match="dropped the request mid-forward"):
        receiver.failure_exception()


@pytest.mark.parametrize("fenced,prefill_cfg", [(False, {}), (True, {}), (True, GATHER)],
                         ids=["direct", "fenced", "fenced-gathered"])
def test_layer_groups_between_prefill_tp2_and_decode_tp1(cluster, fenced, prefill_cfg):
    """Each prefill rank sends its heads of each layer group; decode holds the whole."""
    prefills = [cluster.rank(Role.PREFILL, heads=1, total_heads=2, tp_rank=p, tp_size=2, **{**STAGED, **prefill_cfg})
                for p in range(2)]
    decode = cluster.rank(Role.DECODE, heads=2, total_heads=2, **{**STAGED, "write_fence": fenced})
    room, src, dst = 43, np.arange(8), np.arange(8)[::-1].copy()
    receiver = KVReceiver(decode.mgr, prefills[0].mgr.config.bootstrap_addr, room)
    receiver.init(dst, 2)
    senders = [KVSender(p.mgr, None, room) for p in prefills]
    for p, s in zip(prefills, senders):
        wait_until(p.mgr, lambda s=s: s.poll() is KVPoll.WaitingForInput)
        s.init(8, 1)
    for group in ([1], [0]):
        for s in senders:
            s.send(src, last=True, layers=group)
    wait_until(decode.mgr, lambda: terminal(receiver, *senders), what="room terminal")
    assert all(x.poll() is KVPoll.Success for x in (receiver, *senders))
    for layer in range(NUM_LAYERS):
        for dk, pk in zip(_layer_bytes(decode, dst, layer), zip(*[
                _layer_bytes(p, src, layer) for p in prefills]), strict=True):
            # decode's page of 2 heads: token-major (NHD), each token's heads from the two ranks in order
            whole = np.frombuffer(dk, dtype=np.uint8).reshape(8, 4, 2, -1)
            for r, shard in enumerate(pk):
                assert np.array_equal(whole[:, :, r], np.frombuffer(shard, dtype=np.uint8).reshape(8, 4, 1, -1)[:, :, 0])


def test_a_room_shorter_than_the_threshold_sends_its_groups_whole(cluster):
    """layerwise_min_tokens: a room of fewer prompt tokens holds its layer
    groups until the chunk is complete, then sends it whole."""
    prefill = cluster.rank(Role.PREFILL, layerwise_min_tokens=10_000, **STAGED)
    decode = cluster.rank(Role.DECODE, **{**STAGED, "write_fence": False})
    rng = np.random.default_rng(24)
    src, dst = random_pages(rng, 6), random_pages(rng, 6)
    sender, receiver = opened(prefill, decode, 44, src, dst)
    sender.send(src, last=True, layers=[0])
    time.sleep(0.3)  # streamed, layer 0 lands within milliseconds here (the first test waits for that)
    sender.poll(), receiver.poll()
    zero = [bytes(len(b)) for b in _layer_bytes(decode, dst, 0)]
    assert _layer_bytes(decode, dst, 0) == zero and receiver.poll() is not KVPoll.Success
    sender.send(src, last=True, layers=[1])
    wait_until(decode.mgr, lambda: terminal(sender, receiver), what="room terminal")
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert_landed(prefill, decode, src, dst)
