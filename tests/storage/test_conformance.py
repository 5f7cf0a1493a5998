"""The StorageBackend contract, run against every backend (see conftest.BACKENDS).

Values are pages of torch CPU pools filled with random bytes: each key's value
spans one block per layer and component, and every check compares bytes.
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from transfer.errors import StorageClosedError
from transfer.pools import MHAPool, MLAPool
from transfer.storage.segments import page_bytes, pages_segments, pool_regions


def random_mha(num_pages: int, seed: int, *, layers: int = 3, page_size: int = 4, heads: int = 2,
               head_dim: int = 16, layout: str = "nhd") -> MHAPool:
    g = torch.Generator().manual_seed(seed)
    shape = (num_pages, page_size, heads, head_dim) if layout == "nhd" else (num_pages, heads, page_size, head_dim)

    def rand():
        return torch.randint(-32768, 32767, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
    return MHAPool(k=[rand() for _ in range(layers)], v=[rand() for _ in range(layers)], layout=layout)


def random_mla(num_pages: int, seed: int, *, layers: int = 2, page_size: int = 4, latent: int = 40) -> MLAPool:
    g = torch.Generator().manual_seed(seed)
    return MLAPool(latent=[torch.randint(0, 255, (num_pages, page_size, latent), dtype=torch.uint8, generator=g)
                           for _ in range(layers)])


def tensors(pool) -> list[torch.Tensor]:
    return [t for pair in zip(pool.k, pool.v) for t in pair] if isinstance(pool, MHAPool) else list(pool.latent)


def page_bytes_of(pool, page: int) -> bytes:
    """The page's value as the store should hold it: per layer, per component."""
    return b"".join(t[page].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors(pool))


def fill(pool, value: int) -> None:
    for t in tensors(pool):
        t.view(torch.uint8).fill_(value)


def snapshot(pool) -> list[torch.Tensor]:
    return [t.clone() for t in tensors(pool)]


def unchanged(pool, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(tensors(pool), before))


def registered(backend, *pools):
    for pool in pools:
        backend.register_memory(pool_regions(pool))


@pytest.mark.parametrize("make_pool", [
    lambda n, s: random_mha(n, s), lambda n, s: random_mha(n, s, layout="hnd"), lambda n, s: random_mla(n, s),
], ids=["mha-nhd", "mha-hnd", "mla"])
def test_put_then_get_moves_every_byte_between_random_pages(backend, make_keys, make_pool):
    src, dst = make_pool(40, 1), make_pool(50, 2)
    fill(dst, 0)
    registered(backend, src, dst)
    rng = random.Random(3)
    src_pages, dst_pages = rng.sample(range(40), 12), rng.sample(range(50), 12)
    keys = make_keys(12)
    segments = pages_segments(src, src_pages)
    assert all(len(segs) == len(tensors(src)) > 1 for segs in segments)
    assert backend.put(keys, segments) == [True] * 12
    assert backend.get_into(keys, pages_segments(dst, dst_pages)) == [True] * 12
    for s, d in zip(src_pages, dst_pages):
        assert page_bytes_of(dst, d) == page_bytes_of(src, s)
    untouched = set(range(50)) - set(dst_pages)
    assert all(page_bytes_of(dst, p) == bytes(page_bytes(dst)) for p in untouched)


def test_exists_counts_the_leading_run_of_present_keys(backend, make_keys):
    pool = random_mha(8, 4)
    keys = make_keys(8)
    stored = [0, 1, 2, 3, 5, 6]
    assert backend.put([keys[i] for i in stored], pages_segments(pool, stored)) == [True] * 6
    assert backend.exists(keys) == 4
    assert backend.exists(keys[:3]) == 3
    assert backend.exists(keys[4:]) == 0
    assert backend.exists(keys[5:7]) == 2
    assert backend.exists([]) == 0


def test_overwriting_a_key_leaves_the_new_value(backend, make_keys):
    a, b = random_mha(4, 5), random_mha(4, 6)
    dst = random_mha(4, 7)
    keys = make_keys(3)
    assert backend.put(keys, pages_segments(a, [0, 1, 2])) == [True] * 3
    assert backend.get_into(keys, pages_segments(dst, [0, 1, 2])) == [True] * 3  # read: inside the Store's lease
    # keys[0] and keys[2] overwritten, keys[1] kept; a new key in the same batch
    more = make_keys(1)
    assert backend.put([keys[0], keys[2], more[0]], pages_segments(b, [3, 1, 0])) == [True] * 3
    assert backend.get_into(keys + more, pages_segments(dst, [0, 1, 2, 3])) == [True] * 4
    assert page_bytes_of(dst, 0) == page_bytes_of(b, 3)
    assert page_bytes_of(dst, 1) == page_bytes_of(a, 1)
    assert page_bytes_of(dst, 2) == page_bytes_of(b, 1)
    assert page_bytes_of(dst, 3) == page_bytes_of(b, 0)


def test_overwriting_with_another_size_takes_the_new_size(backend, make_keys):
    small, large = random_mha(2, 8, layers=1), random_mha(2, 9, layers=3)
    key = make_keys(1)
    assert backend.put(key, pages_segments(small, [0])) == [True]
    assert backend.put(key, pages_segments(large, [1])) == [True]
    dst_small, dst_large = random_mha(1, 10, layers=1), random_mha(1, 11, layers=3)
    before = snapshot(dst_small)
    assert backend.get_into(key, pages_segments(dst_small, [0])) == [False]
    assert unchanged(dst_small, before)
    assert backend.get_into(key, pages_segments(dst_large, [0])) == [True]
    assert page_bytes_of(dst_large, 0) == page_bytes_of(large, 1)


def test_a_missing_key_is_a_miss_and_leaves_the_destination_untouched(backend, make_keys):
    src, dst = random_mha(3, 12), random_mha(3, 13)
    keys = make_keys(3)
    assert backend.put([keys[1]], pages_segments(src, [1])) == [True]
    before = snapshot(dst)
    assert backend.get_into([keys[0], keys[2]], pages_segments(dst, [0, 2])) == [False, False]
    assert unchanged(dst, before)
    assert backend.get_into(keys, pages_segments(dst, [0, 1, 2])) == [False, True, False]
    assert page_bytes_of(dst, 1) == page_bytes_of(src, 1)
    assert unchanged_page(dst, before, 0) and unchanged_page(dst, before, 2)


def unchanged_page(pool, before: list[torch.Tensor], page: int) -> bool:
    return all(torch.equal(a[page].view(torch.uint8), b[page].view(torch.uint8))
               for a, b in zip(tensors(pool), before))


@pytest.mark.parametrize("expect", ["larger", "smaller"])
def test_a_size_mismatch_is_a_miss_and_leaves_the_destination_untouched(backend, make_keys, expect):
    src = random_mha(2, 14, layers=2)
    dst = random_mha(2, 15, layers=3 if expect == "larger" else 1)
    key = make_keys(1)
    assert backend.put(key, pages_segments(src, [0])) == [True]
    before = snapshot(dst)
    assert backend.get_into(key, pages_segments(dst, [1])) == [False]
    assert unchanged(dst, before)
    # the same bytes as one segment of the right total size do match
    buf = (ctypes.c_char * page_bytes(src))()
    assert backend.get_into(key, [[(ctypes.addressof(buf), len(buf))]]) == [True]
    assert buf.raw == page_bytes_of(src, 0)


def test_many_keys_in_one_batch(backend, make_keys):
    src, dst = random_mha(600, 16, layers=4), random_mha(600, 17, layers=4)
    registered(backend, src, dst)
    rng = random.Random(18)
    src_pages, dst_pages = rng.sample(range(600), 512), rng.sample(range(600), 512)
    keys = make_keys(512)
    stored = set(rng.sample(range(512), 400))
    assert backend.put([keys[i] for i in sorted(stored)], pages_segments(src, [src_pages[i] for i in sorted(stored)])) \
        == [True] * 400
    results = backend.get_into(keys, pages_segments(dst, dst_pages))
    assert results == [i in stored for i in range(512)]
    for i in stored:
        assert page_bytes_of(dst, dst_pages[i]) == page_bytes_of(src, src_pages[i])
    assert backend.exists(keys) == min(set(range(513)) - stored)


def test_malformed_batches_are_refused_before_anything_happens(backend, make_keys):
    pool = random_mha(2, 19)
    keys = make_keys(2)
    segs = pages_segments(pool, [0, 1])
    with pytest.raises(ValueError, match="keys but"):
        backend.put(keys, segs[:1])
    with pytest.raises(ValueError, match="twice"):
        backend.put([keys[0], keys[0]], segs)
    with pytest.raises(ValueError, match="no segments"):
        backend.get_into(keys[:1], [[]])
    with pytest.raises(ValueError, match="segment"):
        backend.put(keys[:1], [[(segs[0][0][0], 0)]])
    for bad in ["", ".hidden", "a/b", "x" * 201, "sp ace"]:
        with pytest.raises(ValueError, match="invalid storage key"):
            backend.exists([bad])
    assert backend.exists(keys) == 0


def test_close_is_idempotent_and_later_calls_raise(backend, make_keys):
    pool = random_mha(1, 20)
    keys = make_keys(1)
    assert backend.put(keys, pages_segments(pool, [0])) == [True]
    backend.close()
    backend.close()
    with pytest.raises(StorageClosedError):
        backend.exists(keys)
    with pytest.raises(StorageClosedError):
        backend.put(keys, pages_segments(pool, [0]))
    with pytest.raises(StorageClosedError):
        backend.get_into(keys, pages_segments(pool, [0]))


def test_a_second_client_sees_what_the_first_stored(backend_url, make_keys):
    from transfer.storage.base import open_storage
    src, dst = random_mha(4, 21), random_mha(4, 22)
    keys = make_keys(4)
    with open_storage(backend_url) as writer:
        assert writer.put(keys, pages_segments(src, range(4))) == [True] * 4
    with open_storage(backend_url) as reader:
        assert reader.exists(keys) == 4
        assert reader.get_into(keys[::-1], pages_segments(dst, range(4))) == [True] * 4
    for i in range(4):
        assert page_bytes_of(dst, i) == page_bytes_of(src, 3 - i)
