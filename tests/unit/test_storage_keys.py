"""Page keys: a hash chain over tokens bound to a pool fingerprint (pure, no torch)."""

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.messages import AttentionKind, PageLayout, PoolRole
from transfer.storage.keys import KEY_VERSION, PoolFingerprint, chain_hashes, keys_from_chain, page_keys

FP = PoolFingerprint(model="llama-3-8b@main", role="target", attention="mha", page_layout="nhd", dtype="bfloat16",
                     page_size=4, num_layers=32, num_kv_heads=8, head_dim=128)

tokens_st = st.lists(st.integers(0, 2**32), min_size=0, max_size=60)

# The key of the first page [0, 1, 2, 3] in FP; changing how keys are made must bump KEY_VERSION and this.
GOLDEN_FIRST_KEY = "2f7ac11647fbb63330aaadbf70d04439"


@given(tokens_st, st.integers(0, 60))
def test_a_prefix_has_the_prefix_of_the_keys(tokens, cut):
    keys = page_keys(FP, tokens)
    assert len(keys) == len(tokens) // FP.page_size
    assert page_keys(FP, tokens[:cut]) == keys[:cut // FP.page_size]
    assert page_keys(FP, list(tokens)) == keys  # deterministic


@settings(max_examples=200)
@given(st.lists(st.integers(0, 2**32), min_size=4, max_size=60), st.data())
def test_changing_one_token_changes_its_page_key_and_every_later_one(tokens, data):
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = data.draw(st.integers(0, 2**32).filter(lambda t: t != tokens[position]))
    before, after = page_keys(FP, tokens), page_keys(FP, changed)
    page = position // FP.page_size
    assert before[:page] == after[:page]
    assert all(b != a for b, a in zip(before[page:], after[page:]))
    assert not set(before[page:]) & set(after)


@pytest.mark.parametrize("change", [
    {"role": "draft"}, {"tp_rank": 1, "tp_size": 2}, {"tp_size": 2}, {"dtype": "float16"}, {"model": "other"},
    {"page_layout": "hnd"}, {"num_layers": 31}, {"num_kv_heads": 4}, {"head_dim": 64}, {"attention": "mla"},
    {"extra": "lora-7"},
])
@given(tokens=st.lists(st.integers(0, 2**32), min_size=4, max_size=40))
def test_pools_that_differ_in_anything_have_disjoint_keys(change, tokens):
    other = dataclasses.replace(FP, **change)
    assert other.digest != FP.digest
    assert not set(page_keys(FP, tokens)) & set(page_keys(other, tokens))


def test_keys_are_short_lowercase_hex_and_stable_across_releases():
    keys = page_keys(FP, range(9))
    assert len(keys) == 2 and all(len(k) == 32 and int(k, 16) >= 0 and k == k.lower() for k in keys)
    assert KEY_VERSION == 1
    assert keys[0] == page_keys(FP, [0, 1, 2, 3])[0] == GOLDEN_FIRST_KEY


def test_the_golden_key_is_the_same_in_a_fresh_interpreter_with_another_hash_seed():
    code = ("from transfer.storage.keys import PoolFingerprint, page_keys\n"
            "fp = PoolFingerprint(model='llama-3-8b@main', role='target', attention='mha', page_layout='nhd',"
            " dtype='bfloat16', page_size=4, num_layers=32, num_kv_heads=8, head_dim=128)\n"
            "print(page_keys(fp, [0, 1, 2, 3])[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         env={"PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == GOLDEN_FIRST_KEY


def test_one_chain_binds_to_each_pool():
    tokens = list(range(100, 120))
    chains = chain_hashes(tokens, 4)
    draft = dataclasses.replace(FP, role="draft", num_layers=1)
    assert keys_from_chain(FP, chains) == page_keys(FP, tokens)
    assert keys_from_chain(draft, chains) == page_keys(draft, tokens)


def test_token_containers_and_enum_members_are_accepted():
    np = pytest.importorskip("numpy")
    tokens = list(range(12))
    assert page_keys(FP, np.array(tokens, dtype=np.int64)) == page_keys(FP, tokens) == page_keys(FP, range(12))
    with_enums = PoolFingerprint(model=FP.model, role=PoolRole.TARGET, attention=AttentionKind.MHA,
                                 page_layout=PageLayout.NHD, dtype="bfloat16", page_size=4, num_layers=32,
                                 num_kv_heads=8, head_dim=128)
    assert with_enums == FP and with_enums.digest == FP.digest


@pytest.mark.parametrize("change,match", [
    ({"model": ""}, "model"), ({"role": "student"}, "role"), ({"attention": "gqa"}, "attention"),
    ({"page_layout": "x"}, "page_layout"), ({"page_size": 0}, "page_size"), ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
    ({"num_layers": -1}, "num_layers"), ({"dtype": ""}, "dtype"),
])
def test_invalid_fingerprints_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(FP, **change)


def test_invalid_tokens_and_page_sizes_are_refused():
    with pytest.raises(ValueError, match="page 1"):
        page_keys(FP, [0, 1, 2, 3, 4, -5, 6, 7])
    with pytest.raises(ValueError, match="differs"):
        page_keys(FP, range(8), page_size=8)
    with pytest.raises(ValueError, match="page_size"):
        chain_hashes(range(8), 0)


def test_the_keys_module_is_pure():
    code = "import transfer.storage.keys, sys; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = set(out.stdout.split())
    assert "transfer.storage.keys" in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "zmq", "mooncake", "msgpack")}
