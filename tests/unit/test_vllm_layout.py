"""vLLM's CPU KV layout as a kvferry pool (transfer.pools.FusedKVPool), byte-exact.

The layout (vllm-cpu 0.32): every layer is ``[num_blocks, kv_heads, block_size,
2 * head_size]``, all layers views of one buffer; within a (block, head) K fills
the first ``block_size`` rows of ``[2 * block_size, head_size]`` and V the rest.
A plan over the pool's descriptor is executed with memmove between two such
buffers; the destination must hold exactly the source's blocks, K and V in
place, and nothing else may change.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from transfer.plan import plan_pool  # noqa: E402
from transfer.pools import FusedKVPool, describe_pool  # noqa: E402

LAYERS, BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 4, 24, 4, 16, 32


def vllm_cpu_cache(fill: bool, seed: int = 0):
    """One buffer, per-layer views, as vLLM's CPU worker allocates them."""
    shape = (LAYERS, BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    if fill:
        g = torch.Generator().manual_seed(seed)
        buf = torch.randn(shape, generator=g).to(torch.bfloat16)
    else:
        buf = torch.zeros(shape, dtype=torch.bfloat16)
    return buf, [buf[i] for i in range(LAYERS)]


def execute(plan) -> None:
    for src, dst, n in zip(plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.lengths.tolist()):
        ctypes.memmove(dst, src, n)


def k_rows(layer, block, head):
    return layer.view(BLOCKS, HEADS, 2 * BLOCK_SIZE, HEAD_DIM)[block, head, :BLOCK_SIZE]


def v_rows(layer, block, head):
    return layer.view(BLOCKS, HEADS, 2 * BLOCK_SIZE, HEAD_DIM)[block, head, BLOCK_SIZE:]


def test_descriptor_of_the_cpu_layout():
    buf, layers = vllm_cpu_cache(fill=False)
    d = describe_pool(FusedKVPool(kv=layers))
    assert d.num_layers == LAYERS and d.num_pages == BLOCKS and d.page_size == BLOCK_SIZE
    assert d.dtype == "bfloat16" and d.itemsize == 2
    # A block of a layer is one page: all heads' K and V.
    assert d.page_bytes == HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 2
    for layer in range(LAYERS):
        ref = [b for b in d.buffers if b.layer == layer][0]
        assert ref.addr == layers[layer].data_ptr()
        assert ref.nbytes == BLOCKS * d.page_bytes
    # The layers follow each other in the one buffer.
    addrs = sorted(b.addr for b in d.buffers)
    assert np.diff(addrs).tolist() == [BLOCKS * d.page_bytes] * (LAYERS - 1)
    assert addrs[0] == buf.data_ptr()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_blocks_move_byte_exact_with_k_and_v_in_place(seed):
    rng = np.random.default_rng(seed)
    _, src_layers = vllm_cpu_cache(fill=True, seed=seed)
    _, dst_layers = vllm_cpu_cache(fill=False)
    src, dst = describe_pool(FusedKVPool(kv=src_layers)), describe_pool(FusedKVPool(kv=dst_layers))
    n = int(rng.integers(1, BLOCKS))
    # Block 0 is vLLM's null block: requests never hold it.
    src_pages = rng.choice(np.arange(1, BLOCKS), n, replace=False)
    dst_pages = rng.choice(np.arange(1, BLOCKS), n, replace=False)
    plan = plan_pool(src, dst, src_pages, dst_pages)
    execute(plan)
    assert plan.total_bytes == LAYERS * n * src.page_bytes
    moved = set(dst_pages.tolist())
    for layer in range(LAYERS):
        s, d = src_layers[layer], dst_layers[layer]
        for sp, dp in zip(src_pages.tolist(), dst_pages.tolist()):
            assert torch.equal(s[sp].view(torch.int16), d[dp].view(torch.int16)), (layer, sp, dp)
            for head in range(HEADS):
                assert torch.equal(k_rows(s, sp, head).view(torch.int16), k_rows(d, dp, head).view(torch.int16))
                assert torch.equal(v_rows(s, sp, head).view(torch.int16), v_rows(d, dp, head).view(torch.int16))
        for page in set(range(BLOCKS)) - moved:
            assert not d[page].view(torch.int16).any(), (layer, page)


def test_consecutive_blocks_coalesce_per_layer():
    _, src_layers = vllm_cpu_cache(fill=True)
    _, dst_layers = vllm_cpu_cache(fill=False)
    src, dst = describe_pool(FusedKVPool(kv=src_layers)), describe_pool(FusedKVPool(kv=dst_layers))
    plan = plan_pool(src, dst, np.arange(3, 11), np.arange(5, 13))
    # One run of 8 blocks: one descriptor per layer (layers are BLOCKS pages apart).
    assert plan.num_descriptors == LAYERS
    assert plan.lengths.tolist() == [8 * src.page_bytes] * LAYERS


def test_a_heads_k_and_v_are_one_contiguous_slice_of_its_block():
    """What heterogeneous TP would move per (block, head): one run of bytes."""
    _, layers = vllm_cpu_cache(fill=True)
    layer = layers[1]
    block, head = 7, 2
    head_bytes = BLOCK_SIZE * 2 * HEAD_DIM * 2
    start = layer.data_ptr() + (block * HEADS + head) * head_bytes
    assert k_rows(layer, block, head).data_ptr() == start
    assert v_rows(layer, block, head).data_ptr() == start + head_bytes // 2
    raw = (ctypes.c_char * head_bytes).from_address(start).raw
    want = torch.cat([k_rows(layer, block, head), v_rows(layer, block, head)]).contiguous()
    assert raw == want.view(torch.uint8).numpy().tobytes()


def test_shapes_that_are_not_the_cpu_layout_are_refused():
    _, layers = vllm_cpu_cache(fill=False)
    with pytest.raises(ValueError, match="2 \\* head_dim"):
        describe_pool(FusedKVPool(kv=[t[..., :HEAD_DIM - 1] .contiguous() for t in layers]))
    with pytest.raises(ValueError, match="contiguous"):
        describe_pool(FusedKVPool(kv=[t.transpose(1, 2) for t in layers]))
    with pytest.raises(ValueError, match="no fused"):
        describe_pool(FusedKVPool(kv=[]))


# --- strided pages (transfer.plan.StridedPages): cross-layer blocks and head slices ---

from transfer.plan import StridedPages, plan_strided  # noqa: E402

HEAD_BLOCK = BLOCK_SIZE * 2 * HEAD_DIM * 2  # one head's K and V rows of a block, bytes
PAGE = HEADS * HEAD_BLOCK


def per_layer(buf, heads=HEADS) -> StridedPages:
    """LBHNC: ``buf`` is [layers, blocks, heads, block_size, 2*head_dim]."""
    page = heads * HEAD_BLOCK
    return StridedPages(tuple(buf.data_ptr() + l * BLOCKS * page for l in range(LAYERS)), BLOCKS, page, heads,
                        HEAD_BLOCK)


def cross_layer(buf) -> StridedPages:
    """BLHNC: ``buf`` is [blocks, layers, heads, block_size, 2*head_dim]."""
    return StridedPages(tuple(buf.data_ptr() + l * PAGE for l in range(LAYERS)), BLOCKS, LAYERS * PAGE, HEADS,
                        HEAD_BLOCK)


def randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def same(a, b) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def pages_of(rng, n):
    return rng.choice(np.arange(1, BLOCKS), n, replace=False)


def test_strided_plan_of_the_cpu_layout_equals_the_pool_plan():
    buf_a, layers_a = vllm_cpu_cache(fill=True)
    buf_b, layers_b = vllm_cpu_cache(fill=False)
    rng = np.random.default_rng(5)
    src, dst = pages_of(rng, 9), pages_of(rng, 9)
    a = plan_strided(per_layer(buf_a), per_layer(buf_b), src, dst)
    b = plan_pool(describe_pool(FusedKVPool(kv=layers_a)), describe_pool(FusedKVPool(kv=layers_b)), src, dst)
    for x, y in ((a.src_addrs, b.src_addrs), (a.dst_addrs, b.dst_addrs), (a.lengths, b.lengths)):
        assert x.tolist() == y.tolist()


@pytest.mark.parametrize("seed", [1, 2])
def test_cross_layer_blocks_to_per_layer_buffers_byte_exact(seed):
    rng = np.random.default_rng(seed)
    src_buf = randn((BLOCKS, LAYERS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM), seed)  # BLHNC
    dst_buf = torch.zeros((LAYERS, BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM), dtype=torch.bfloat16)  # LBHNC
    n = int(rng.integers(1, BLOCKS))
    src, dst = pages_of(rng, n), pages_of(rng, n)
    plan = plan_strided(cross_layer(src_buf), per_layer(dst_buf), src, dst)
    execute(plan)
    assert plan.total_bytes == LAYERS * n * PAGE
    for layer in range(LAYERS):
        for sp, dp in zip(src.tolist(), dst.tolist()):
            assert same(src_buf[sp, layer], dst_buf[layer, dp]), (layer, sp, dp)
    untouched = sorted(set(range(BLOCKS)) - set(dst.tolist()))
    assert not dst_buf[:, untouched].view(torch.int16).any()


@pytest.mark.parametrize("decode_tp", [2, 4])
def test_head_slices_for_a_larger_decode_tp_byte_exact(decode_tp):
    """Prefill TP 1 holds all heads; decode rank r of TP ``decode_tp`` gets
    heads [r * h, (r + 1) * h), each page's slice one descriptor."""
    rng = np.random.default_rng(decode_tp)
    src_buf = randn((LAYERS, BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM), decode_tp)
    h = HEADS // decode_tp
    n = 7
    src = pages_of(rng, n)
    for rank in range(decode_tp):
        dst_buf = torch.zeros((LAYERS, BLOCKS, h, BLOCK_SIZE, 2 * HEAD_DIM), dtype=torch.bfloat16)
        dst = pages_of(rng, n)
        plan = plan_strided(per_layer(src_buf), per_layer(dst_buf, heads=h), src, dst,
                            src_head_offset=rank * h, num_heads=h)
        execute(plan)
        assert plan.total_bytes == LAYERS * n * h * HEAD_BLOCK
        for layer in range(LAYERS):
            for sp, dp in zip(src.tolist(), dst.tolist()):
                assert same(src_buf[layer, sp, rank * h:(rank + 1) * h], dst_buf[layer, dp]), (rank, layer, sp)


def test_strided_plans_refuse_what_does_not_fit():
    buf, _ = vllm_cpu_cache(fill=False)
    good = per_layer(buf)
    with pytest.raises(ValueError, match="page stride"):
        StridedPages(good.layer_addrs, BLOCKS, PAGE - 1, HEADS, HEAD_BLOCK)
    with pytest.raises(ValueError, match="head slice"):
        plan_strided(good, good, [1], [2], src_head_offset=3, num_heads=2)
    with pytest.raises(IndexError, match="outside the pool"):
        plan_strided(good, good, [BLOCKS], [2])
    with pytest.raises(ValueError, match="layer counts"):
        plan_strided(good, StridedPages(good.layer_addrs[:2], BLOCKS, PAGE, HEADS, HEAD_BLOCK), [1], [1])
