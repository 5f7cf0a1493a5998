"""Reslicing a sharded state item between TP sizes (transfer.state_slices): pure."""

import pytest

from bootstrap.messages import StateBuffer, StatePoolDescriptor
from transfer.state_slices import check_slices, row_blocks, senders


def _buf(dim, outer=1, groups=(), unit=6):
    return StateBuffer(addr=4096, item_bytes=max(1, dim) * outer * unit, num_items=8, slice_dim=dim,
                       slice_outer=outer, slice_groups=groups)


def test_a_gdn_conv_state_goes_sub_block_by_sub_block():
    """Query/key/value channels (4, 4, 8 over all ranks) each split on their
    own: prefill rank 1 of 2 writes its half of each into decode's item at
    that sub-block's place; at 1 -> 2 decode rank 1 takes the second half of each."""
    p, d = _buf(8, groups=(4, 4, 8)), _buf(16, groups=(4, 4, 8))
    rb = row_blocks(p, d, 1, 2, 0, 1, first_sender=False)
    assert rb.blocks == ((0, 2 * 6, 2 * 6), (2 * 6, 6 * 6, 2 * 6), (4 * 6, 12 * 6, 4 * 6))
    rb = row_blocks(d, p, 0, 1, 1, 2, first_sender=True)
    assert rb.blocks == ((2 * 6, 0, 2 * 6), (6 * 6, 2 * 6, 2 * 6), (12 * 6, 4 * 6, 4 * 6))
    assert rb.item_bytes == 8 * 6


def test_a_window_page_goes_head_by_head_in_every_token_row():
    rb = row_blocks(_buf(1, outer=4, unit=16), _buf(2, outer=4, unit=16), 1, 2, 0, 1, first_sender=False)
    assert (rb.rows, rb.src_row, rb.dst_row, rb.blocks) == (4, 16, 32, ((0, 16, 16),))


def test_equal_tp_and_buffers_without_an_axis_move_whole_items():
    assert row_blocks(_buf(2), _buf(2), 1, 2, 1, 2, first_sender=True).blocks == ((0, 0, 12),)
    assert row_blocks(_buf(0), _buf(0), 1, 2, 0, 1, first_sender=False).blocks == ()
    assert row_blocks(_buf(0), _buf(0), 0, 2, 0, 1, first_sender=True).blocks == ((0, 0, 6),)
    pool = StatePoolDescriptor(kind="mamba", sharding="sharded", exact=True, buffers=(_buf(2),))
    assert senders(pool, 0, 4, 1, 2) == (2, 3) and senders(pool, 0, 1, 1, 2) == (0,) and senders(pool, 0, 2, 1, 2) == (1,)


@pytest.mark.parametrize("src, dst, words", [
    (_buf(2), _buf(4, unit=3), "rows x unit bytes"),
    (_buf(2), _buf(3), "holds 4 units over prefill's 2 ranks, 3 over decode's 1"),
    (_buf(2, groups=(2, 2)), _buf(4), "slice sub-blocks"),
    (_buf(3, groups=(3, 3)), _buf(6, groups=(3, 3)), "does not split over 2 and 1 ranks"),
    (_buf(0), _buf(4), "a slice axis on one side only"),
])
def test_slices_that_cannot_be_resliced_are_named(src, dst, words):
    with pytest.raises(ValueError, match=words):
        check_slices(src, dst, 2, 1, "buffer 0 of state mamba")
