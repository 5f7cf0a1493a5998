"""The write fence over the loopback pair: a fenced decode rank registers only
its staging arenas, rooms land byte-exact through them, and a write held by
a peer taken for lost never reaches pages the scheduler reused after the
room reported Failed. The loopback fabric validates a write when it is
submitted (``validate_on_submit``), as Mooncake's TCP transport does: an
accepted write lands even into memory unregistered since."""

import threading
import time

import numpy as np
import pytest
import torch

from transfer import KVPoll, KVReceiver, KVSender
from transfer.staging.arenas import StagingArenas, span_tensor

from ._rooms import NUM_PAGES, Role, assert_landed, random_pages, run_room, wait_until

STAGED = dict(staging_bytes=1 << 20, stage_part_bytes=64 << 10, stage_below_bytes=16 << 10)
SENTINEL = 0xA5


def _regions_inside(regions, base: int, nbytes: int) -> bool:
    return all(base <= a and a + n <= base + nbytes for a, n in regions)


@pytest.mark.parametrize("prefill_staging", [1 << 20, 0])
def test_fenced_rooms_land_byte_exact_and_decode_exposes_only_staging(cluster, prefill_staging):
    prefill = cluster.rank(Role.PREFILL, **{**STAGED, "staging_bytes": prefill_staging})
    decode = cluster.rank(Role.DECODE, **STAGED)
    assert decode.mgr.rank.fenced and not prefill.mgr.rank.fenced
    span = decode.mgr.rank.staging
    assert _regions_inside(decode.mgr.transport.regions, span.addr, span.nbytes), "pool memory registered"
    rng = np.random.default_rng(prefill_staging)
    for room, contiguous in enumerate([True, False, True, False]):
        n = int(rng.integers(8, 40))
        start = int(rng.integers(0, NUM_PAGES - n))
        src = np.arange(start, start + n) if contiguous else random_pages(rng, n)
        dst = np.arange(NUM_PAGES - n, NUM_PAGES) if contiguous else random_pages(rng, n)
        src_aux, dst_aux = int(rng.integers(0, 8)), int(rng.integers(0, 8))
        sender, receiver = run_room(prefill, decode, 40 + room, src, dst, chunks=2, src_aux=src_aux, dst_aux=dst_aux)
        assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
        assert_landed(prefill, decode, src, dst, src_aux, dst_aux)
    area = decode.mgr.context.staging.area
    wait_until(decode.mgr, lambda: area.free_bytes == area.nbytes, what="staging regions freed")
    assert area.num_retired == 0


def _held_room(cluster, prefill, decode, room, src, dst):
    """A room whose one (last) chunk's write the fabric holds after it was
    submitted and accepted."""
    submitted = threading.Event()
    submit = prefill.mgr.transport.submit

    def spy(peer, plan, callback, ready, priority=0.0):
        handle = submit(peer, plan, callback, ready, priority)
        if plan.num_descriptors:
            submitted.set()
        return handle

    prefill.mgr.transport.submit = spy
    receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, room)
    receiver.init(dst, 2)
    sender = KVSender(prefill.mgr, None, room)
    wait_until(prefill.mgr, lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.init(len(src), 1)
    cluster.fabric.hold_writes()
    sender.send(src, last=True)
    assert submitted.wait(5.0), "the chunk's write was never submitted"
    return sender, receiver


@pytest.mark.parametrize("fence", [True, False], ids=["fenced", "unfenced-documents-the-hole"])
def test_a_held_write_of_a_lost_peer_never_reaches_reused_pages(cluster, fence):
    """Prefill submits a contiguous chunk and goes silent (its write held, as
    a SIGSTOPped process's); decode fails the room on liveness; the
    scheduler at once reuses the pages (a sentinel); the write is released.
    Fenced: the sentinel stays, the arena is retired and replaced, the next
    rooms land exactly. Unfenced (the hole, documented): the late write
    overwrites the sentinel."""
    cluster.fabric.validate_on_submit = True
    direct = {**STAGED, "stage_below_bytes": 1024}  # the chunk's 8 KiB runs are written, not gathered
    prefill = cluster.rank(Role.PREFILL, **direct, peer_timeout_s=30.0)
    decode = cluster.rank(Role.DECODE, **direct, write_fence=fence, heartbeat_interval_s=0.05,
                          peer_timeout_s=0.5)
    rng = np.random.default_rng(7)
    src, dst = np.arange(4, 36), np.arange(20, 52)  # contiguous: a direct part (fenced) or direct write
    sender, receiver = _held_room(cluster, prefill, decode, 50, src, dst)
    cluster.fabric.cut(prefill.mgr.rank.control_endpoint)
    wait_until(decode.mgr, lambda: receiver.poll() is KVPoll.Failed, what="decode fails the room (peer lost)")
    for t in (*decode.k, *decode.v):  # the scheduler reuses the pages at once
        t.view(torch.uint8)[torch.as_tensor(dst)] = SENTINEL
    sentinel = decode.page_bytes(dst)
    cluster.fabric.mend(prefill.mgr.rank.control_endpoint)
    cluster.fabric.release_writes()
    wait_until(prefill.mgr, lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed), what="prefill done")
    time.sleep(0.3)  # ChunkStaged / RoomStatus of the dead room reach decode
    if not fence:
        assert decode.page_bytes(dst) == prefill.page_bytes(src), "the late write did not land (hole closed?)"
        return
    assert decode.page_bytes(dst) == sentinel, "a late write of a failed room reached its pages"
    area = decode.mgr.context.staging.area
    assert area.num_retired == 1 and area.free_bytes == area.nbytes
    span = decode.mgr.rank.staging
    assert _regions_inside(decode.mgr.transport.regions, span.addr, span.nbytes)
    assert len(decode.mgr.transport.regions) == len(area.arenas)
    # The next rooms are unaffected: random bytes, random pages, exact.
    for room in (51, 52):
        src, dst = random_pages(rng, 24), random_pages(rng, 24)
        s, r = run_room(prefill, decode, room, src, dst, chunks=2)
        assert (s.poll(), r.poll()) == (KVPoll.Success, KVPoll.Success)
        assert_landed(prefill, decode, src, dst)


def test_arenas_retire_replace_and_never_reuse_a_poisoned_range():
    arena_bytes = 64 << 10
    tensor = span_tensor(arena_bytes, 2, torch.device("cpu"))
    registered: list[tuple[int, int]] = []
    unregistered: list[tuple[int, int]] = []
    arenas = StagingArenas(tensor, arena_bytes, 2, registered.extend, unregistered.extend)
    base = tensor.data_ptr()
    assert registered == [(base, arena_bytes), (base + arena_bytes, arena_bytes)]
    rng = np.random.default_rng(11)
    poisoned: list[tuple[int, int]] = []
    for round_ in range(40):
        grants = [(off, n) for n in rng.integers(1, 24 << 10, size=4).tolist()
                  if (off := arenas.alloc(n)) is not None]
        assert grants, "no live arena left"
        for off, n in grants:
            assert not any(p <= off < p + pn or off <= p < off + n for p, pn in poisoned), "poisoned range reused"
            assert off // arena_bytes == (off + n - 1) // arena_bytes, "grant across an arena end"
        victim, *others = grants
        tensor[victim[0]:victim[0] + victim[1]] = 0xFF  # a late write lands there
        before = len(unregistered)
        arenas.poison(*victim)
        poisoned.append(victim)
        slot = victim[0] // arena_bytes
        probe = arenas.alloc(4096)  # no new grant in a retired arena
        assert probe is None or probe // arena_bytes != slot
        for off, n in others + ([(probe, 4096)] if probe is not None else []):
            arenas.free(off, n)
        assert len(unregistered) == before + 1 and unregistered[-1] == (base + slot * arena_bytes, arena_bytes)
        # Released, not unmapped: the range reads back as fresh zero pages.
        assert int(tensor[slot * arena_bytes:(slot + 1) * arena_bytes].max()) == 0
        assert len(arenas.arenas) == 2 and arenas.num_retired == round_ + 1
    live = {a.slot for a in arenas.arenas}
    assert min(live) >= 40 and registered[-1][0] >= base + 40 * arena_bytes


PAGE_BYTES = 1 << 10  # 2 layers x K/V x 4 tokens x 2 heads x 16 x bf16
ROOM_PAGES = 4


def _open_rooms(prefill, decode, rooms) -> dict:
    """room -> (sender, receiver, src, dst): decode asked for each room in
    order (ROOM_PAGES scattered pages), prefill took each up, nothing sent."""
    order = np.random.default_rng(64).permutation(NUM_PAGES)
    opened = {}
    for i, room in enumerate(rooms):
        src = order[i * ROOM_PAGES:(i + 1) * ROOM_PAGES]
        dst = order[NUM_PAGES // 2 + i * ROOM_PAGES:NUM_PAGES // 2 + (i + 1) * ROOM_PAGES]
        receiver = KVReceiver(decode.mgr, prefill.mgr.config.bootstrap_addr, room)
        receiver.init(dst, 2)
        opened[room] = (KVSender(prefill.mgr, None, room), receiver, src, dst)
    for sender, _, src, _ in opened.values():
        wait_until(prefill.mgr, lambda s=sender: s.poll() is KVPoll.WaitingForInput, what="decode's request")
        sender.init(len(src), 1)
    return opened


def _send_and_land(prefill, decode, rooms: dict) -> None:
    """Send each of ``rooms`` whole, in order; each lands byte-exact in one part."""
    for sender, _, src, _ in rooms.values():
        sender.send(src, last=True)
    wait_until(decode.mgr, lambda: all(r.poll() in (KVPoll.Success, KVPoll.Failed) for _, r, _, _ in rooms.values()),
               timeout_s=8.0, what="the rooms terminal")
    for room, (sender, receiver, src, dst) in rooms.items():
        wait_until(prefill.mgr, lambda s=sender: s.poll() in (KVPoll.Success, KVPoll.Failed), what="prefill done")
        assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success), (room, receiver.stats())
        assert decode.page_bytes(dst) == prefill.page_bytes(src), room
        assert receiver.stats().num_parts == 1  # one part a room: each needs one region on each side


def test_rooms_granted_with_their_requests_never_wait_behind_rooms_asking_for_staging(cluster, monkeypatch):
    """Decode's staging fits two rooms and, as a decode without the cap on
    such grants would, gives it all to the first two requests; prefill
    gathers through a staging that fits two parts and sends the two other
    rooms first. Their parts ask decode for a region holding nothing on
    prefill, so the granted rooms take prefill's staging, land, free
    decode's, and the asking rooms then get theirs: every room lands
    byte-exact. (Prefill's staging taken before the grant hung all four
    until the transfer timeout: 64 concurrent 128-token rooms on NIXL did so.)"""
    monkeypatch.setattr("transfer.rooms.staged_decode.PREGRANT_SHARE", 1.0)
    room_bytes = ROOM_PAGES * PAGE_BYTES
    prefill = cluster.rank(Role.PREFILL, staging_bytes=2 * room_bytes, stage_part_bytes=room_bytes,
                           stage_below_bytes=1 << 30)
    decode = cluster.rank(Role.DECODE, staging_bytes=2 * room_bytes, stage_part_bytes=room_bytes,
                          stage_below_bytes=1 << 30)
    assert decode.mgr.rank.fenced
    rooms = _open_rooms(prefill, decode, range(70, 74))
    _send_and_land(prefill, decode, {room: rooms[room] for room in (72, 73, 70, 71)})  # the rooms without a region first


def test_regions_granted_with_requests_leave_half_the_staging_to_rooms_prefill_computed(cluster):
    """Decode's staging fits four rooms; six requests come, and prefill
    computes the last two first (the first four wait in its scheduler, say
    behind a full KV cache). Regions granted with requests hold only half
    the staging, so the two computed rooms find room to ask for and land
    while the first four are still unsent; then those land too. (Granting
    every request a region while it fits gave the first four the whole
    staging: the computed rooms waited for regions that only rooms prefill
    could not compute yet would free.)"""
    room_bytes = ROOM_PAGES * PAGE_BYTES
    prefill = cluster.rank(Role.PREFILL, staging_bytes=4 * room_bytes, stage_part_bytes=room_bytes,
                           stage_below_bytes=1 << 30)
    decode = cluster.rank(Role.DECODE, staging_bytes=4 * room_bytes, stage_part_bytes=room_bytes,
                          stage_below_bytes=1 << 30)
    rooms = _open_rooms(prefill, decode, range(80, 86))
    staging = decode.mgr.rooms.staging
    assert sum(1 for room in range(80, 86) if "1 room region(s) granted with the request"
               in staging.describe(room, rooms[room][1].request_id)) == 2
    _send_and_land(prefill, decode, {room: rooms[room] for room in (84, 85)})
    _send_and_land(prefill, decode, {room: rooms[room] for room in range(80, 84)})
