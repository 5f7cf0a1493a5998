"""The staged parts, one type per kind (transfer.rooms.parts): each counts
its own bytes, names its own landing message, and plans its own
descriptors; the messages round-trip the codec."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bootstrap import codec
from bootstrap.messages import PoolRole, StateBuffer, StatePoolDescriptor, StateSharding
from transfer.messages import PagesStaged, ShareStaged, StateStaged
from transfer.plan import page_slice, staged_bytes
from transfer.rooms.parts import LayerShare, PagePart, StatePart, gathered_plan, source_plan
from transfer.state_slices import RowBlocks

from ._fixtures import make_pool

REQ = SimpleNamespace(request_id=7)


def _part(granted: int | None) -> PagePart:
    target = make_pool(num_layers=3, num_pages=32)
    draft = make_pool(role=PoolRole.DRAFT, num_layers=1, num_pages=32, base=0x6600_0000_0000)
    pools = tuple((p, page_slice(p, 0, p.num_kv_heads)) for p in (target, draft))
    pages = np.array([3, 4, 5, 9, 20], dtype=np.int64)
    nbytes = sum(staged_bytes(p, sl, pages.size) for p, sl in pools)
    return PagePart(REQ, 4, pages, 10, pools, nbytes, direct=True, granted=granted)


def _roundtrip(msg):
    again = codec.decode(codec.encode(msg))
    assert again == msg and type(again) is type(msg)
    return again


def test_a_page_part_counts_every_pool_and_lands_as_pages():
    part = _part(granted=None)
    target, draft = (p for p, _ in part.pools)
    per_page = [staged_bytes(p, sl, 1) for p, sl in part.pools]
    assert part.write_bytes == part.region_bytes == part.nbytes == 5 * sum(per_page)
    assert part.moved() == (("target", 5 * per_page[0], 1), ("draft", 5 * per_page[1], 0))
    msg = _roundtrip(part.landed(12, 1, 4096, (target, draft)))
    assert isinstance(msg, PagesStaged) and (msg.page_start, msg.num_pages, msg.nbytes) == (10, 5, part.nbytes)
    plan = source_plan(part, 1 << 40)
    assert int(plan.lengths.sum()) == part.nbytes and plan.dst_addrs[0] == 1 << 40
    assert gathered_plan(part, 1 << 30, 1 << 40).num_descriptors == 1


@pytest.mark.parametrize("granted", [None, 1 << 20], ids=["own-region", "in-place"])
def test_a_layer_share_counts_and_names_only_its_layers(granted):
    whole = _part(granted)
    target, draft = (p for p, _ in whole.pools)
    share = LayerShare(whole, 9, {PoolRole.TARGET: (0, 2), PoolRole.DRAFT: (0,)})
    per_layer = [staged_bytes(p, sl, 5, 1) for p, sl in whole.pools]
    assert share.write_bytes == 2 * per_layer[0] + per_layer[1]
    assert share.in_place is (granted is not None)
    assert share.region_bytes == (whole.nbytes if granted is not None else share.write_bytes)
    assert share.moved() == (("target", 2 * per_layer[0], 1), ("draft", per_layer[1], 0))
    msg = _roundtrip(share.landed(12, 1, 4096, (target, draft)))
    # room layers: the target's 0 and 2, then the draft's 0 after the target's three
    assert isinstance(msg, ShareStaged) and msg.layers == (0, 2, 3) and msg.part == 9
    assert msg.nbytes == share.region_bytes
    src, lengths = share.source_entries()
    assert int(lengths.sum()) == share.write_bytes
    plan = gathered_plan(share, 1 << 30, 1 << 40)
    assert int(plan.lengths.sum()) == share.write_bytes
    # in place: one per range of the slot (target layer 0; target layer 2 and the draft, adjacent, merged)
    assert plan.num_descriptors == (2 if granted is not None else 1)


def test_a_state_part_counts_its_kind_and_lands_as_items():
    pool = StatePoolDescriptor(kind="mamba", sharding=StateSharding.REPLICATED, exact=True,
                               buffers=(StateBuffer(addr=0x5000_0000, item_bytes=256, num_items=8),
                                        StateBuffer(addr=0x6000_0000, item_bytes=64, num_items=8)))
    blocks = (RowBlocks(1, 256, 256, ((0, 0, 256),)), RowBlocks(1, 64, 64, ((0, 0, 64),)))
    part = StatePart(REQ, 2, 0, pool, blocks, np.array([5, 1], dtype=np.int64), 3, 640, direct=True)
    assert part.granted is None and not part.in_place and part.write_bytes == part.region_bytes == 640
    assert part.moved() == (("state:mamba", 640, 1),)
    msg = _roundtrip(part.landed(12, 0, 0, ()))
    assert isinstance(msg, StateStaged) and (msg.state_pool, msg.item_start, msg.num_items) == (0, 3, 2)
    src, lengths = part.source_entries()
    assert src.tolist() == [0x5000_0000 + 5 * 256, 0x5000_0000 + 256, 0x6000_0000 + 5 * 64, 0x6000_0000 + 64]
    assert lengths.tolist() == [256, 256, 64, 64]
