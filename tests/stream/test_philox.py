"""Philox4x32-10: Random123 known-answer vectors, and the int and tensor paths agreeing."""

from __future__ import annotations

import random

import pytest
import torch

import keyinit
from keyinit._bits.philox import M0, M1, ROUNDS, W0, W1, philox4x32, stream_words

# Random123 tests/kat_vectors, philox4x32 with 10 rounds: (counter, key, output).
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

MASK32 = 0xFFFFFFFF


def philox_textbook(counter, key):
    """Philox4x32-10 written directly from the Random123 definition with Python ints."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
    return (c0, c1, c2, c3)


def test_constants():
    assert (M0, M1, W0, W1, ROUNDS) == (0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 10)


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_kat_python_ints(counter, key, expected):
    assert philox4x32(counter, key) == expected
    assert philox4x32(counter, key) == tuple(int(w) for w in philox4x32(tuple(torch.tensor(c) for c in counter), key))
    assert philox_textbook(counter, key) == expected


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_kat_int64_tensors(counter, key, expected):
    tensors = tuple(torch.tensor([c], dtype=torch.int64) for c in counter)
    out = philox4x32(tensors, key)
    assert all(o.dtype == torch.int64 for o in out)
    assert tuple(int(o.item()) for o in out) == expected


def test_kat_through_stream_words_and_bits():
    expected = list(KAT[0][2])
    words = stream_words((0, 0), torch.arange(4, dtype=torch.int64), 1)
    assert words[0].tolist() == expected
    assert keyinit.random.bits(keyinit.key(0), (4,)).tolist() == expected
    assert keyinit.random.bits(keyinit.Key(0, 0), (2, 2)).flatten().tolist() == expected


@pytest.mark.parametrize("counter, key, expected", KAT[1:])
def test_kat_keys_through_stream_words(counter, key, expected):
    # stream_words only reaches counters (b_lo, b_hi, 0, 0): check that lane j of
    # block b is Philox((b_lo, b_hi, 0, 0), key)[j] for a key from the KAT vectors.
    k = keyinit.Key(*key)
    # blocks stay below 2**60 so that 4 * block + 4 elements fit MAX_NUMEL = 2**62
    blocks = [0, 1, 0xFFFFFFFF, 0x1_0000_0000, ((counter[1] >> 4) << 32) | counter[0]]
    for block in blocks:
        element = torch.arange(4 * block, 4 * block + 4, dtype=torch.int64)
        got = keyinit.random.bits(k, (4 * block + 4,), region=(element,)).tolist()
        assert got == list(philox4x32((block & MASK32, block >> 32, 0, 0), key))


@pytest.mark.parametrize("w", [1, 2, 4])
def test_stream_words_layout(w):
    key = (0x12345678, 0x9ABCDEF0)
    element = torch.tensor([0, 1, 2, 3, 5, 1000, 2**40 + 3], dtype=torch.int64)
    words = stream_words(key, element, w)
    assert len(words) == w
    for pos, i in enumerate(element.tolist()):
        for m in range(w):
            j = w * i + m
            assert int(words[m][pos]) == philox4x32((j // 4 & MASK32, j // 4 >> 32, 0, 0), key)[j % 4]


def test_stream_words_rejects_w_not_dividing_4():
    with pytest.raises(ValueError, match="words_per_element must divide 4, got 3"):
        stream_words((0, 0), torch.arange(3), 3)


def test_tensor_path_equals_int_path_on_random_counters():
    rng = random.Random(20240601)
    n = 2000
    for _ in range(5):
        key = (rng.getrandbits(32), rng.getrandbits(32))
        counters = [[rng.getrandbits(32) for _ in range(n)] for _ in range(4)]
        # include the extremes in every lane
        for lane in counters:
            lane[:2] = [0, MASK32]
        tensors = tuple(torch.tensor(lane, dtype=torch.int64) for lane in counters)
        out = torch.stack(philox4x32(tensors, key)).T.tolist()
        for i in range(n):
            expected = philox_textbook(tuple(lane[i] for lane in counters), key)
            assert tuple(out[i]) == expected
            if i < 50:
                assert philox4x32(tuple(lane[i] for lane in counters), key) == expected


def test_outputs_are_uint32_in_int64():
    rng = random.Random(7)
    tensors = tuple(torch.tensor([rng.getrandbits(32) for _ in range(4096)], dtype=torch.int64) for _ in range(4))
    for lane in philox4x32(tensors, (MASK32, MASK32)):
        assert int(lane.min()) >= 0 and int(lane.max()) <= MASK32
