"""Huge-page host memory for staging and the benchmark's pools."""

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from transfer.staging.hostmem import HUGE_PAGE, host_array, host_tensor, is_huge_backed, smaps_kib


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text else ""


def test_host_array_is_filled_writable_and_exactly_sized():
    a = host_array(3 * HUGE_PAGE + 5, fill=0x5A)
    assert a.dtype == np.uint8 and a.size == 3 * HUGE_PAGE + 5
    assert int(a.min()) == int(a.max()) == 0x5A
    a[-1] = 7
    assert a[-1] == 7 and host_array(0).size == 0


def test_an_untouched_buffer_faults_in_only_what_is_used():
    a = host_array(32 * HUGE_PAGE, fill=None)  # the staging buffer's way: no start-up cost
    assert smaps_kib(a.ctypes.data, "Rss") < 4 * HUGE_PAGE // 1024
    a[:8 * HUGE_PAGE] = 9
    assert 8 * HUGE_PAGE // 1024 <= smaps_kib(a.ctypes.data, "Rss") < 12 * HUGE_PAGE // 1024
    assert int(a[8 * HUGE_PAGE:].max()) == 0 and int(a[:8 * HUGE_PAGE].min()) == 9


def test_host_tensor_shares_the_array_memory():
    t = host_tensor(HUGE_PAGE, fill=3)
    assert t.dtype == torch.uint8 and t.numel() == HUGE_PAGE and int(t.sum()) == 3 * HUGE_PAGE
    t.view(torch.int64)[0] = -1  # words view, as staging uses it
    assert int(t[:8].numpy().view(np.int64)[0]) == -1


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_large_buffers_are_backed_by_huge_pages():
    assert is_huge_backed(host_tensor(8 * HUGE_PAGE)) is True
    assert is_huge_backed(host_array(8 * HUGE_PAGE)) is True


def test_memory_is_unmapped_with_its_last_reference():
    t = host_tensor(4 * HUGE_PAGE, fill=1)
    view = t[HUGE_PAGE:].view(torch.int32)
    addr = t.data_ptr()
    del t
    gc.collect()
    assert smaps_kib(addr, "Rss") is not None, "a view keeps the mapping alive"
    assert int(view[0]) == 0x01010101
    del view
    gc.collect()
    assert smaps_kib(addr, "Rss") is None
