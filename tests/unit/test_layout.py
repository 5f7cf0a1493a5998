"""transfer.layout.check_compatible: the handshake's field-by-field checks."""

from __future__ import annotations

import pytest

from bootstrap.messages import AttentionKind, PageLayout, PoolRole
from transfer.errors import IncompatibleLayoutError, KVFerryError
from transfer.layout import check_compatible, layout_fingerprint

from ._fixtures import make_aux, make_pool, make_rank, mha_rank


def _pools(**kw):
    """Target (and optional draft) pool kwargs -> pools tuple."""
    draft = kw.pop("draft", None)
    pools = [make_pool(**kw)]
    if draft is not None:
        pools.append(make_pool(role=PoolRole.DRAFT, base=0x6600_0000_0000, **draft))
    return pools


BASE = dict(num_layers=4, page_size=16, num_kv_heads=8, total_kv_heads=8, head_dim=128, dtype="bfloat16",
            itemsize=2)


def pair(prefill_kw=None, decode_kw=None, *, prefill_tp=1, decode_tp=1, prefill_aux="default",
         decode_aux="default"):
    p_kw = {**BASE, **(prefill_kw or {})}
    d_kw = {**BASE, **(decode_kw or {})}
    prefill = make_rank(node_id="prefill", tp_size=prefill_tp, pools=_pools(**p_kw), aux=prefill_aux)
    decode = make_rank(node_id="decode", tp_size=decode_tp, pools=_pools(**d_kw), aux=decode_aux)
    return prefill, decode


def expect_mismatch(prefill, decode, field, **kw) -> IncompatibleLayoutError:
    """Both directions (checked from the prefill side and from the decode side) name ``field``."""
    with pytest.raises(IncompatibleLayoutError) as a:
        check_compatible(prefill, decode, local_is_prefill=True, **kw)
    with pytest.raises(IncompatibleLayoutError) as b:
        check_compatible(decode, prefill, local_is_prefill=False, **kw)
    assert a.value.field == b.value.field == field
    assert field in str(a.value)
    # local/remote follow the caller's point of view
    assert (a.value.local, a.value.remote) == (b.value.remote, b.value.local)
    assert isinstance(a.value, KVFerryError)
    return a.value


def test_identical_layouts_pass():
    prefill, decode = pair()
    check_compatible(prefill, decode, local_is_prefill=True)
    check_compatible(decode, prefill, local_is_prefill=False)


def test_identical_with_draft_pass():
    prefill, decode = pair({"draft": dict(num_layers=1)}, {"draft": dict(num_layers=1)})
    check_compatible(prefill, decode, local_is_prefill=True)


def test_addresses_and_num_pages_may_differ():
    prefill, decode = pair({"num_pages": 100, "base": 0x1000_0000}, {"num_pages": 7})
    check_compatible(prefill, decode, local_is_prefill=True)


@pytest.mark.parametrize(
    "field, p_kw, d_kw, local, remote",
    [
        ("target.page_size", {"page_size": 16}, {"page_size": 32}, 16, 32),
        ("target.dtype", {"dtype": "bfloat16"}, {"dtype": "float16"}, "bfloat16", "float16"),
        ("target.itemsize", {"dtype": "x", "itemsize": 2}, {"dtype": "x", "itemsize": 4}, 2, 4),
        ("target.num_layers", {"num_layers": 4}, {"num_layers": 3}, 4, 3),
        ("target.head_dim", {"head_dim": 128}, {"head_dim": 64}, 128, 64),
        ("target.total_kv_heads", {"num_kv_heads": 8, "total_kv_heads": 8},
         {"num_kv_heads": 4, "total_kv_heads": 4}, 8, 4),
        ("target.attention", {}, {"attention": AttentionKind.MLA, "head_dim": 576}, "mha", "mla"),
        ("draft.page_size", {"draft": dict(page_size=16)}, {"draft": dict(page_size=64)}, 16, 64),
        ("target.page_layout", {}, {"page_layout": PageLayout.HND}, "nhd", "hnd"),
    ],
)
def test_field_mismatch(field, p_kw, d_kw, local, remote):
    prefill, decode = pair(p_kw, d_kw)
    err = expect_mismatch(prefill, decode, field)
    assert (err.local, err.remote) == (local, remote)


def test_draft_on_decode_only():
    prefill, decode = pair({}, {"draft": dict(num_layers=1)})
    err = expect_mismatch(prefill, decode, "draft pool")
    assert (err.local, err.remote) == ("absent", "present")
    assert "allow_missing_draft" in str(err)
    # allowed when the decode side opts in
    check_compatible(prefill, decode, local_is_prefill=True, allow_missing_draft=True)
    check_compatible(decode, prefill, local_is_prefill=False, allow_missing_draft=True)


def test_draft_on_prefill_only_is_never_allowed():
    prefill, decode = pair({"draft": dict(num_layers=1)}, {})
    expect_mismatch(prefill, decode, "draft pool")
    expect_mismatch(prefill, decode, "draft pool", allow_missing_draft=True)


def test_tp_ratio_that_does_not_divide():
    prefill = mha_rank(tp_size=3, total_heads=6)
    decode = mha_rank(tp_size=2, total_heads=6)
    err = expect_mismatch(prefill, decode, "tp_size")
    assert (err.local, err.remote) == (3, 2)


def test_valid_hetero_tp():
    # prefill tp 2 with 4 heads per rank vs decode tp 1 with all 8
    for r in range(2):
        prefill = mha_rank(tp_rank=r, tp_size=2, total_heads=8)
        assert prefill.pools[0].num_kv_heads == 4
        decode = mha_rank(tp_size=1, total_heads=8)
        check_compatible(prefill, decode, local_is_prefill=True)
        check_compatible(decode, prefill, local_is_prefill=False)
    # and the other way round, with GQA replication on the decode side
    check_compatible(mha_rank(tp_size=1, total_heads=2), mha_rank(tp_rank=3, tp_size=4, total_heads=2),
                     local_is_prefill=True)


def test_num_kv_heads_inconsistent_with_tp():
    prefill, decode = pair(prefill_tp=2)  # tp 2 but holding all 8 heads
    with pytest.raises(IncompatibleLayoutError) as ei:
        check_compatible(prefill, decode, local_is_prefill=True)
    assert ei.value.field == "target.num_kv_heads"
    assert (ei.value.local, ei.value.remote) == (8, 4)


def test_total_heads_that_do_not_split_over_tp():
    prefill = make_rank(tp_size=4, pools=[make_pool(num_kv_heads=1, total_kv_heads=6)])
    decode = make_rank(tp_size=1, pools=[make_pool(num_kv_heads=6, total_kv_heads=6)])
    expect_mismatch(prefill, decode, "target.total_kv_heads")


def test_aux_on_one_side_only():
    prefill, decode = pair(decode_aux=None)
    err = expect_mismatch(prefill, decode, "aux")
    assert (err.local, err.remote) == (True, False)
    prefill, decode = pair(prefill_aux=None, decode_aux=None)
    check_compatible(prefill, decode, local_is_prefill=True)


def test_aux_slot_bytes_differ():
    prefill, decode = pair(prefill_aux=make_aux(slot_bytes=64), decode_aux=make_aux(slot_bytes=128))
    err = expect_mismatch(prefill, decode, "aux.slot_bytes")
    assert (err.local, err.remote) == (64, 128)


def test_mla_layouts_pass_across_tp():
    mla = dict(attention=AttentionKind.MLA, head_dim=576, dtype="bfloat16")
    prefill = make_rank(tp_size=4, tp_rank=2, pools=[make_pool(**mla)])
    decode = make_rank(tp_size=8, tp_rank=5, pools=[make_pool(**mla)])
    check_compatible(prefill, decode, local_is_prefill=True)


def test_layout_fingerprint():
    a = make_pool(**BASE)
    assert layout_fingerprint(a) == layout_fingerprint(make_pool(**BASE, base=0x1234_0000, num_pages=3))
    assert layout_fingerprint(a) != layout_fingerprint(make_pool(**{**BASE, "page_size": 32}))
    assert layout_fingerprint(a) != layout_fingerprint(make_pool(role=PoolRole.DRAFT, **BASE))
    assert len(layout_fingerprint(a)) == 16
