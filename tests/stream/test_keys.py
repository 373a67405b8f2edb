"""Keys: value semantics, derivation rules of stream v1, domain separation, validation."""

from __future__ import annotations

import hashlib
import struct

import attrs
import numpy as np
import pytest
import torch

import keyinit
from keyinit import Key, fold_in, key, key_for, split
from keyinit._bits.philox import philox4x32

MASK32 = 0xFFFFFFFF


def derive_by_hand(parent: Key, tag: int, x0: int, x1: int, x3: int) -> Key:
    out = philox4x32((x0, x1, tag, x3), parent.words)
    return Key(out[0], out[1])


# ---------------------------------------------------------------- value semantics


def test_key_is_immutable():
    k = key(5)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        k.k0 = 1  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        k.stream = "v2"  # type: ignore[misc]
    assert k == key(5)


def test_key_equality_and_hash():
    assert Key(1, 2) == Key(1, 2) and hash(Key(1, 2)) == hash(Key(1, 2))
    assert Key(1, 2) != Key(2, 1)
    assert Key(1, 2) != (1, 2)
    assert len({Key(1, 2), Key(1, 2), Key(2, 1)}) == 2
    assert {key(3): "x"}[Key(3, 0)] == "x"


def test_key_ordering_is_by_words_then_stream():
    keys = [Key(1, 0), Key(0, MASK32), Key(0, 1), Key(MASK32, 0), Key(0, 0)]
    assert sorted(keys) == [Key(0, 0), Key(0, 1), Key(0, MASK32), Key(1, 0), Key(MASK32, 0)]
    assert Key(0, 1) < Key(1, 0) and not Key(1, 0) < Key(1, 0)


def test_key_repr_and_words():
    assert repr(Key(0, 1)) == "Key(0x00000000, 0x00000001, stream='v1')"
    assert repr(key(0xDEADBEEF_0BADF00D)) == "Key(0x0badf00d, 0xdeadbeef, stream='v1')"
    assert key(0xDEADBEEF_0BADF00D).words == (0x0BADF00D, 0xDEADBEEF)


@pytest.mark.parametrize("seed, words", [
    (0, (0, 0)), (1, (1, 0)), (MASK32, (MASK32, 0)), (2**32, (0, 1)), (2**64 - 1, (MASK32, MASK32)),
])
def test_root_key_is_lo32_hi32(seed, words):
    k = key(seed)
    assert (k.k0, k.k1) == words and k.words == words and k.stream == "v1"


def test_root_key_accepts_integer_like_seeds():
    assert key(np.int64(7)) == key(7) and key(np.uint64(2**64 - 1)) == key(2**64 - 1)


@pytest.mark.parametrize("bad", [-1, 2**32, True, 1.0, "1", None])
def test_key_words_validated(bad):
    with pytest.raises(ValueError, match=r"key words must be ints in \[0, 2\*\*32\)"):
        Key(bad, 0)
    with pytest.raises(ValueError, match=r"key words must be ints in \[0, 2\*\*32\)"):
        Key(0, bad)


# ---------------------------------------------------------------- streams


def test_stream_versions():
    assert keyinit.STREAM_VERSIONS == ("v1", "v2")
    assert keyinit.DEFAULT_STREAM == "v1"
    assert key(3, stream="v1") == key(3)
    assert Key(1, 2, "v1") == Key(1, 2)


@pytest.mark.parametrize("stream", ["v3", "V1", "", None, 1])
def test_unknown_stream_rejected(stream):
    with pytest.raises(ValueError, match=r"unknown stream version .*; this release supports \['v1', 'v2'\]"):
        key(0, stream=stream)
    with pytest.raises(ValueError, match="unknown stream version"):
        Key(0, 0, stream)


def test_derived_keys_keep_stream():
    k = key(9, stream="v1")
    assert all(child.stream == "v1" for child in (*split(k, 3), fold_in(k, 1), fold_in(k, "a"), key_for(k, "a.b")))


# ---------------------------------------------------------------- derivation rules


def test_split_matches_spec_counter_layout():
    k = key(0x0123456789ABCDEF)
    children = split(k, 5)
    assert children == tuple(derive_by_hand(k, 1, i, 0, 0) for i in range(5))


def test_split_prefix_consistency():
    k = key(42)
    assert split(k, 0) == ()
    assert split(k, 1) == split(k, 7)[:1]
    assert split(k, 3) == split(k, 2) + (split(k, 3)[2],)
    assert split(k, 100)[:37] == split(k, 37)
    assert split(k) == split(k, 2)


def test_split_children_distinct_from_parent_and_each_other():
    k = key(1)
    children = split(k, 64)
    assert len(set(children)) == 64 and k not in children


def test_fold_in_int_matches_spec():
    k = key(2024)
    for d in (0, 1, MASK32, 2**32, 2**32 + 5, 2**64 - 1):
        assert fold_in(k, d) == derive_by_hand(k, 2, d & MASK32, d >> 32, 0)
    assert fold_in(k, np.int32(5)) == fold_in(k, 5)


@pytest.mark.parametrize("text", ["", "weight", "0", "tok_embeddings", "émoji 🎲", "a" * 1000])
def test_fold_in_str_is_sha256_words(text):
    k = key(2024)
    h0, h1, h2 = struct.unpack("<3I", hashlib.sha256(text.encode("utf-8")).digest()[:12])
    assert fold_in(k, text) == derive_by_hand(k, 3, h0, h1, h2)


def test_fold_in_str_worked_example_from_spec():
    # docs/spec.md section 3: SHA-256("tok_embeddings") starts 2e b9 bf 46 f0 5c 58 05 57 7b 8b 77
    h = struct.unpack("<3I", hashlib.sha256(b"tok_embeddings").digest()[:12])
    assert h == (0x46BFB92E, 0x05585CF0, 0x778B7B57)


def test_domain_separation():
    for k in (key(0), key(2**64 - 1), key_for(3, "x.y")):
        derived = [fold_in(k, 1), fold_in(k, "1"), split(k, 2)[1], fold_in(k, 0), fold_in(k, "0"), split(k)[0]]
        assert len(set(derived)) == len(derived)
        assert fold_in(k, 1) != fold_in(k, "1") != split(k, 2)[1] != fold_in(k, 1)


def test_fold_in_int_uses_high_word():
    k = key(11)
    assert len({fold_in(k, 0), fold_in(k, 2**32), fold_in(k, 2**63), fold_in(k, 1)}) == 4


def test_fold_in_and_split_are_deterministic():
    assert fold_in(key(5), "abc") == fold_in(key(5), "abc")
    assert split(key(5), 4) == split(key(5), 4)
    assert fold_in(key(5), "abc") != fold_in(key(6), "abc")


# ---------------------------------------------------------------- key_for


def test_key_for_is_a_fold_in_chain():
    root = key(7)
    expected = fold_in(fold_in(fold_in(fold_in(root, "layers"), "0"), "attention"), "wq")
    assert key_for(root, "layers.0.attention.wq") == expected
    assert key_for(7, "layers.0.attention.wq") == expected
    assert key_for(root, "weight") == fold_in(root, "weight")


def test_key_for_numeric_component_is_a_string():
    root = key(7)
    assert key_for(root, "layers.0") == fold_in(fold_in(root, "layers"), "0")
    assert key_for(root, "layers.0") != fold_in(fold_in(root, "layers"), 0)


def test_key_for_component_boundaries_matter():
    assert key_for(0, "a.bc") != key_for(0, "ab.c")
    assert key_for(0, "a.b") != key_for(0, "ab")
    assert key_for(0, "a.b") != key_for(0, "b.a")


def test_key_for_composes_and_subtrees_depend_only_on_path():
    root = key(123)
    assert key_for(key_for(root, "encoder.layers"), "3.mlp.weight") == key_for(root, "encoder.layers.3.mlp.weight")
    # the same subtree moved under another parent keeps relative structure but not values
    a = key_for(root, "encoder.layers.3")
    b = key_for(root, "decoder.layers.3")
    assert key_for(a, "mlp.weight") == key_for(root, "encoder.layers.3.mlp.weight")
    assert key_for(a, "mlp.weight") != key_for(b, "mlp.weight")
    # siblings do not influence each other: the key of one path is computed from that path alone
    assert key_for(root, "x.weight") == fold_in(fold_in(root, "x"), "weight")


@pytest.mark.parametrize("fqn", ["", ".", "a.", ".a", "a..b"])
def test_key_for_rejects_empty_components(fqn):
    with pytest.raises(ValueError, match="fqn must be non-empty dot-separated names"):
        key_for(0, fqn)


# ---------------------------------------------------------------- many keys


def _split_words_tensor(parent: Key, count: int, tag: int = 1) -> torch.Tensor:
    """Words of split(parent, count) (tag 1) or fold_in(parent, i) (tag 2), as 64-bit ints, in one tensor call."""
    index = torch.arange(count, dtype=torch.int64)
    lo, hi = index & MASK32, index >> 32
    out = philox4x32((lo, hi, torch.full_like(index, tag), torch.zeros_like(index)), parent.words)
    return _pack(out[0], out[1])


def _pack(k0, k1):
    """An injective int64 packing of two words: k0 + (k1 - 2**31) * 2**32 never overflows."""
    return k0 + (k1 - 2**31) * 2**32


def _unpack(packed: int) -> tuple[int, int]:
    return packed & MASK32, ((packed >> 32) + 2**31) & MASK32


def test_million_split_keys_all_distinct():
    parent = key_for(0, "layers.0.attention.wq.weight")
    n = 10**6
    packed = _split_words_tensor(parent, n)
    # the vectorized path is the same derivation as keyinit.split
    sample = split(parent, 1000)
    assert [_unpack(int(p)) for p in packed[:1000]] == [c.words for c in sample]
    assert torch.unique(packed).numel() == n
    # and none collides with fold_in(parent, i) keys (a different domain) or the parent
    folded = _split_words_tensor(parent, 200_000, tag=2)
    assert [_unpack(int(p)) for p in folded[:50]] == [
        fold_in(parent, i).words for i in range(50)
    ]
    together = torch.cat([packed, folded, torch.tensor([_pack(parent.k0, parent.k1)])])
    assert torch.unique(together).numel() == together.numel()
