"""benchmarks.busy_ranks' one-process raw Mooncake reference checks the
last room's pages byte for byte once its loop ended."""

import numpy as np

from benchmarks.busy_loop import FIRST_ROOM, BusyConfig, src_pages
from benchmarks.busy_ranks import _wrong_bytes

CFG = BusyConfig(pages=4, layers=2, heads=1, head_dim=8, page_size=2)


def _arenas(room: int, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, CFG.num_buffers * CFG.prefill_pages * CFG.page_bytes, dtype=np.uint8)
    dst = rng.integers(0, 256, CFG.num_buffers * CFG.decode_pages * CFG.page_bytes, dtype=np.uint8)
    sv = src.reshape(CFG.num_buffers, CFG.prefill_pages, CFG.page_bytes)
    dv = dst.reshape(CFG.num_buffers, CFG.decode_pages, CFG.page_bytes)
    dv[:, dst_pages] = sv[:, src_pages(CFG, room - FIRST_ROOM)]
    return src, dst


def test_the_last_room_is_passed_only_when_every_page_of_every_buffer_arrived():
    room, pages = FIRST_ROOM + 3, np.array([7, 2, 11, 5], dtype=np.int64)
    src, dst = _arenas(room, pages)
    assert _wrong_bytes(CFG, src, dst, (room, pages)) == []
    dv = dst.reshape(CFG.num_buffers, CFG.decode_pages, CFG.page_bytes)
    dv[CFG.num_buffers - 1, pages[-1], -1] ^= 1  # the last byte of the last page of the last buffer
    assert _wrong_bytes(CFG, src, dst, (room, pages)) == [room]


def test_pages_in_another_order_are_wrong_bytes():
    room, pages = FIRST_ROOM, np.array([1, 3, 4, 9], dtype=np.int64)
    src, dst = _arenas(room, pages)
    assert _wrong_bytes(CFG, src, dst, (room, pages[::-1].copy())) == [room]
    assert _wrong_bytes(CFG, src, dst, None) == []
