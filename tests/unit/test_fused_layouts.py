"""vLLM's layouts as wire-level pools (transfer.fused_pool), pure and in-process.

- FusedKVPool reads the physical order from the strides of vLLM's per-layer
  views (LBHNC, LBNHC, BLHNC, BLNHC) and refuses the others by name;
- the descriptor's new fields (kv_layout, page_stride_bytes) stay off the
  wire while they hold their defaults, so older peers decode every pool
  that does not use them and refuse, naming the field, one that does;
- the handshake names both sides' layouts where no plan bridges them;
- plans (direct) and staged copies (gather, scatter) over every layout and
  head slice move exactly the right bytes (executed with memmove here; the
  multi-process Mooncake runs are tests/layouts/test_vllm_layouts.py).
"""

from __future__ import annotations

import ctypes
import dataclasses

import msgpack
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bootstrap import codec  # noqa: E402
from bootstrap.errors import ProtocolError  # noqa: E402
from bootstrap.messages import Component, KVLayout, PageLayout  # noqa: E402
from transfer.errors import IncompatibleLayoutError  # noqa: E402
from transfer.messages import PeerHello  # noqa: E402
from transfer.layout import check_compatible, layout_name  # noqa: E402
from transfer.plan import page_slice, plan_pool  # noqa: E402
from transfer.pools import FusedKVPool, describe_pool, pool_tensors  # noqa: E402
from transfer.staging.copies import gather, scatter  # noqa: E402

from ._fixtures import make_rank  # noqa: E402

L, B, H, N, D = 3, 12, 4, 8, 8  # layers, blocks, KV heads (this rank), block size, head dim
LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")


def vllm_cache(layout: str, heads: int = H, seed: int | None = None):
    """(raw buffer, vLLM's per-layer logical views [B, heads, N, 2D])."""
    shape = {"LBHNC": (L, B, heads, N, 2 * D), "LBNHC": (L, B, N, heads, 2 * D),
             "BLHNC": (B, L, heads, N, 2 * D), "BLNHC": (B, L, N, heads, 2 * D)}[layout]
    if seed is None:
        raw = torch.zeros(shape, dtype=torch.int16)
    else:
        raw = torch.randint(-32768, 32767, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int16)
    raw = raw.view(torch.bfloat16)
    views = []
    for layer in range(L):
        v = raw[layer] if layout.startswith("LB") else raw[:, layer]
        views.append(v if layout.endswith("HNC") else v.permute(0, 2, 1, 3))
    return raw, views


def pool(layout, views, kv_layout="fused_cells", total=None):
    return FusedKVPool(kv=views, total_kv_heads=total, kv_layout=kv_layout, vllm_layout=layout)


def execute(plan) -> None:
    for src, dst, n in zip(plan.src_addrs.tolist(), plan.dst_addrs.tolist(), plan.lengths.tolist()):
        ctypes.memmove(dst, src, n)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_descriptor_follows_the_strides(layout):
    raw, views = vllm_cache(layout)
    d = describe_pool(pool(layout, views))
    page = H * N * 2 * D * 2
    assert (d.attention.value, d.kv_layout, d.components) == ("mha", KVLayout.FUSED_CELLS, (Component.KV,))
    assert d.page_layout is (PageLayout.HND if layout.endswith("HNC") else PageLayout.NHD)
    assert (d.num_kv_heads, d.head_dim, d.page_size, d.num_pages, d.page_bytes) == (H, D, N, B, page)
    assert d.page_stride == (page if layout.startswith("LB") else L * page)
    assert d.page_stride_bytes == (0 if layout.startswith("LB") else L * page)
    assert [d.buffer(i, Component.KV).addr for i in range(L)] == [v.data_ptr() for v in views]
    assert layout_name(d) == f"vLLM {layout}"
    assert raw.data_ptr() == d.buffer(0, Component.KV).addr


def test_cpu_layout_names_its_packing():
    _, views = vllm_cache("LBHNC")
    d = describe_pool(FusedKVPool(kv=views))  # the default: vLLM's CPU backend
    assert d.kv_layout is KVLayout.FUSED_ROWS and layout_name(d) == "vLLM CPU (LBHNC, K rows then V rows)"


def test_refusals_name_the_layout():
    _, views = vllm_cache("LBNHC")
    with pytest.raises(ValueError, match="fused_rows"):
        describe_pool(FusedKVPool(kv=views))  # the CPU packing only exists head-major
    with pytest.raises(ValueError, match="do not match vLLM layout LBHNC"):
        describe_pool(pool("LBHNC", views))
    with pytest.raises(ValueError, match="LHBNC is not supported"):
        describe_pool(pool("LHBNC", views))
    raw = torch.zeros((L, H, B, N, 2 * D), dtype=torch.bfloat16)  # LHBNC: a head of all blocks together
    with pytest.raises(ValueError, match="LHBNC and BHLNC"):
        describe_pool(FusedKVPool(kv=[raw[i].transpose(0, 1) for i in range(L)], kv_layout="fused_cells"))


def _hello(rank):
    return PeerHello(rank=rank, allow_missing_draft=False)


def _body(d):
    return msgpack.unpackb(codec.encode(_hello(make_rank(pools=[d]))), raw=False)["body"]["rank"]["pools"][0]


def test_new_fields_stay_off_the_wire_while_default():
    old = make_rank()  # kvferry's own split pools
    body = _body(old.pools[0])
    assert "kv_layout" not in body and "page_stride_bytes" not in body
    assert codec.decode(codec.encode(_hello(old))).rank == old
    _, cross = vllm_cache("BLHNC")
    d = describe_pool(pool("BLHNC", cross))
    body = _body(d)
    assert body["kv_layout"] == "fused_cells" and body["page_stride_bytes"] == L * H * N * 2 * D * 2
    assert codec.decode(codec.encode(_hello(make_rank(pools=[d])))).rank.pools[0] == d


def test_a_peer_that_predates_the_fields_refuses_them_by_name(monkeypatch):
    """An older peer's PoolDescriptor has no kv_layout: decoding a fused pool
    raises ProtocolError naming the field, never a misread pool."""
    _, views = vllm_cache("LBHNC")
    data = codec.encode(_hello(make_rank(pools=[describe_pool(pool("LBHNC", views))])))
    from bootstrap.descriptors import PoolDescriptor
    old_fields = {n: f for n, f in codec._fields(PoolDescriptor).items() if n not in ("kv_layout", "page_stride_bytes")}
    monkeypatch.setattr(codec, "_fields", lambda cls: old_fields if cls is PoolDescriptor else
                        {f.name: f for f in dataclasses.fields(cls)})
    with pytest.raises(ProtocolError, match="kv_layout"):
        codec.decode(data)


def _ranks(p_layout, d_layout, p_kind="fused_cells", d_kind="fused_cells"):
    _, pv = vllm_cache(p_layout)
    _, dv = vllm_cache(d_layout)
    return (make_rank(node_id="p", pools=[describe_pool(pool(p_layout, pv, p_kind))], aux=()),
            make_rank(node_id="d", pools=[describe_pool(pool(d_layout, dv, d_kind))], aux=()))


@pytest.mark.parametrize("p_layout, d_layout", [("BLHNC", "LBHNC"), ("LBNHC", "BLNHC"), ("LBHNC", "LBHNC")])
def test_page_strides_are_bridged(p_layout, d_layout):
    p, d = _ranks(p_layout, d_layout)
    check_compatible(p, d, local_is_prefill=True)
    check_compatible(d, p, local_is_prefill=False)


@pytest.mark.parametrize("p_layout, d_layout, p_kind, d_kind, p_name, d_name", [
    ("LBHNC", "LBHNC", "fused_rows", "fused_cells", "vLLM CPU (LBHNC, K rows then V rows)", "vLLM LBHNC"),
    ("LBHNC", "LBNHC", "fused_cells", "fused_cells", "vLLM LBHNC", "vLLM LBNHC"),
    ("BLNHC", "BLHNC", "fused_cells", "fused_cells", "vLLM BLNHC", "vLLM BLHNC"),
])
def test_unbridgeable_layouts_are_named(p_layout, d_layout, p_kind, d_kind, p_name, d_name):
    p, d = _ranks(p_layout, d_layout, p_kind, d_kind)
    with pytest.raises(IncompatibleLayoutError) as err:
        check_compatible(d, p, local_is_prefill=False)
    assert err.value.field == "target.kv_layout"
    assert f"local {d_name!r}, remote {p_name!r}" in str(err.value)


def test_split_against_fused_is_named():
    from ._fixtures import make_pool
    _, views = vllm_cache("LBHNC")
    p = make_rank(node_id="p", pools=[describe_pool(pool("LBHNC", views))], aux=())
    d = make_rank(node_id="d", pools=[make_pool(num_layers=L, page_size=N, num_kv_heads=H, total_kv_heads=H,
                                                head_dim=D, dtype="bfloat16", itemsize=2)], aux=())
    with pytest.raises(IncompatibleLayoutError, match="split nhd.*vLLM LBHNC"):
        check_compatible(d, p, local_is_prefill=False)


def _views(raw, layout):
    out = []
    for layer in range(L):
        v = raw[layer] if layout.startswith("LB") else raw[:, layer]
        out.append(v if layout.endswith("HNC") else v.permute(0, 2, 1, 3))
    return out


CASES = [(lay, lay) for lay in LAYOUTS] + [("BLHNC", "LBHNC"), ("LBNHC", "BLNHC")]


@pytest.mark.parametrize("p_layout, d_layout", CASES)
@pytest.mark.parametrize("tp", ["1to1", "2to1", "1to2"])
@pytest.mark.parametrize("path", ["plan", "staged"])
def test_pages_and_head_slices_move_byte_exact(p_layout, d_layout, tp, path):
    """Random blocks (and, for TP 2 <-> 1, the head slice one rank moves):
    the destination holds exactly them; every other byte is unchanged."""
    rng = np.random.default_rng(abs(hash((p_layout, d_layout, tp, path))) % 2**32)
    p_heads, d_heads = {"1to1": (H, H), "2to1": (H // 2, H), "1to2": (H, H // 2)}[tp]
    src_raw, src_views = vllm_cache(p_layout, p_heads, seed=int(rng.integers(1 << 30)))
    dst_raw, dst_views = vllm_cache(d_layout, d_heads, seed=int(rng.integers(1 << 30)))
    sp, dp = describe_pool(pool(p_layout, src_views, total=H)), describe_pool(pool(d_layout, dst_views, total=H))
    # the slice rank 1 of the TP-2 side holds / wants
    num, s_off, d_off = {"1to1": (H, 0, 0), "2to1": (H // 2, 0, H // 2), "1to2": (H // 2, H // 2, 0)}[tp]
    n = int(rng.integers(1, B))
    src_pages, dst_pages = rng.choice(B, n, replace=False), rng.choice(B, n, replace=False)
    want = dst_raw.clone()
    src_idx, dst_idx = torch.as_tensor(src_pages), torch.as_tensor(dst_pages)
    for want_layer, src_layer in zip(_views(want, d_layout), src_views):
        want_layer[dst_idx, d_off:d_off + num] = src_layer[src_idx][:, s_off:s_off + num]
    if path == "plan":
        execute(plan_pool(sp, dp, src_pages, dst_pages, src_head_offset=s_off, dst_head_offset=d_off,
                          num_heads=num))
    else:
        s_sl, d_sl = page_slice(sp, s_off, num), page_slice(dp, d_off, num)
        staging = torch.zeros(B * L * sp.page_bytes, dtype=torch.uint8)
        gather(staging, 0, pool_tensors([pool(p_layout, src_views, total=H)]), sp, s_sl,
               torch.as_tensor(src_pages))
        scatter(staging, 0, pool_tensors([pool(d_layout, dst_views, total=H)]), dp, d_sl,
                torch.as_tensor(dst_pages))
    assert torch.equal(dst_raw.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_storage_segments_of_a_fused_pool(layout):
    """The storage tier stores a page as each layer's block, in physical order;
    its key fingerprint is per TP rank and names the packing."""
    from transfer.storage.segments import pages_segments, pool_fingerprint
    raw, views = vllm_cache(layout, seed=3)
    p = pool(layout, views, total=2 * H)
    page = 5
    segs = pages_segments(p, [page])[0]
    got = b"".join(ctypes.string_at(addr, n) for addr, n in segs)
    want = b"".join((v[page] if layout == "LBHNC" else v[page].permute(1, 0, 2)).contiguous()
                    .view(torch.uint8).numpy().tobytes() for v in views)
    assert got == want
    a = pool_fingerprint(p, model="m", tp_rank=0, tp_size=2)
    b = pool_fingerprint(p, model="m", tp_rank=1, tp_size=2)
    assert a != b and a.extra == "fused_cells" and a.num_kv_heads == H


def test_storage_refuses_cross_layer_blocks():
    from transfer.storage.segments import pages_segments
    _, views = vllm_cache("BLHNC")
    with pytest.raises(ValueError, match="cross-layer"):
        pages_segments(pool("BLHNC", views), [1])
