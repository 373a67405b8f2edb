"""docs/spec.md section 17 (keyed stochastic rounding) recomputed from its text alone, and the golden vectors.

``_spec_round`` is an independent implementation of 17.1-17.2 in exact rational arithmetic: it lists
the target's values from 17.1's formula, finds ``lo`` and ``hi = lo + q`` by bisection, and compares
``x + floor((a - lo) * 2**32 / q)`` with ``2**32``. The words come from section 1/4's Philox
(``philox4x32`` on Python ints, pinned by its known-answer vectors). ``tests/sround/golden_sround_v1.json``
was written once by ``python -m tests.sround.test_sround_golden`` from ``_spec_round`` (never from
``keyinit.random.stochastic_round``); the tests check that the file still is what the text gives and
that the implementation gives it, for whole tensors and regions.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import struct
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import keyinit
from keyinit._bits.philox import philox4x32
from keyinit.random import stochastic_round

GOLDEN = Path(__file__).with_name("golden_sround_v1.json")

#: 17.1's table: bits, p, emin, emax, infinity (None: none), NaN, largest finite (magnitude bits).
FORMATS = {
    "bfloat16": (16, 8, -126, 127, 0x7F80, 0x7FC0, 0x7F7F),
    "float16": (16, 11, -14, 15, 0x7C00, 0x7E00, 0x7BFF),
    "float8_e5m2": (8, 3, -14, 15, 0x7C, 0x7E, 0x7B),
    "float8_e4m3fn": (8, 4, -6, 8, None, 0x7F, 0x7E),
}
SOURCES = {"float32": torch.float32, "float64": torch.float64}


def word(key_words: tuple[int, int], j: int) -> int:
    """Section 4: ``word(K, j) = Philox((lo32(j // 4), hi32(j // 4), 0, 0), K)[j mod 4]``."""
    block = j // 4
    return philox4x32((block & 0xFFFFFFFF, block >> 32, 0, 0), key_words)[j % 4]


@functools.lru_cache(maxsize=None)
def _values(name: str) -> list[Fraction]:
    """Every non-negative value of the format with ``emin`` kept and the exponent range up to
    ``emax + 1`` (17.1's formula, a binade past the format's), in bit order: index = magnitude bits."""
    _, p, emin, emax, *_ = FORMATS[name]
    out = []
    for f in range(0, emax - emin + 3):
        for t in range(1 << (p - 1)):
            if f == 0:
                out.append(Fraction(t) * Fraction(2) ** (emin - p + 1))
            else:
                out.append((2 ** (p - 1) + t) * Fraction(2) ** (f - 1 + emin - p + 1))
    return out


def _spec_round(value: float, x: int, name: str) -> int:
    """17.2 for one element: the target bits of ``value`` (an exact binary64 of the source) with word ``x``."""
    nbits, p, emin, emax, inf, nan, largest = FORMATS[name]
    sign = (1 << (nbits - 1)) if math.copysign(1.0, value) < 0 else 0
    if math.isnan(value):
        return sign | nan
    if math.isinf(value):
        return sign | (inf if inf is not None else 0x7F)
    a = abs(Fraction(value))
    if a >= Fraction(2) ** (emax + 1):
        return sign | (inf if inf is not None else largest)
    values = _values(name)
    index = bisect.bisect_right(values, a) - 1  # lo = values[index] <= a
    lo, hi = values[index], values[index + 1]
    r = math.floor((a - lo) * 2**32 / (hi - lo))
    assert 0 <= r < 2**32
    bits = index + (1 if x + r >= 2**32 else 0)
    overflow = values[bits] >= Fraction(2) ** (emax + 1) or bits > largest
    if overflow:
        return sign | (inf if inf is not None else largest)
    return sign | bits


def _bits_of(value: float, source: str) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0] if source == "float32" else \
        struct.unpack("<Q", struct.pack("<d", value))[0]


def _value_of(bits: int, source: str) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0] if source == "float32" else \
        struct.unpack("<d", struct.pack("<Q", bits))[0]


def _inputs(source: str, name: str) -> list[float]:
    """Values that reach every clause of 17.2 for ``name``: representable, between neighbours,
    negative, zeros, subnormals (source and target), near and past the largest finite, NaN, inf."""
    _, p, emin, emax, *_ = FORMATS[name]
    largest = float(_values(name)[FORMATS[name][6]])
    q_max = 2.0 ** (emax - p + 1)
    q_min = 2.0 ** (emin - p + 1)
    picks = [1.0, -1.0, 0.0, -0.0, 1 + 2.0 ** -(p + 1), -(1 + 2.0 ** -(p + 1)), 1 + 0.3 * 2.0 ** -(p - 1),
             math.pi, -math.e, 1e-3, largest, -largest, largest + q_max / 4, largest + 3 * q_max / 4,
             2.0 ** (emax + 1), -(2.0 ** (emax + 1)) * 3, 0.5 * q_min, 0.75 * q_min, 2.5 * q_min,
             2.0 ** emin * 0.999, -(2.0 ** emin) * 1.0625, q_min * 2.0 ** -31, q_min * 2.0 ** -33,
             float("nan"), float("inf"), float("-inf"), 1e-45, -1e-40, 3.0e38, 7.0]
    if source == "float64":
        picks += [1 + 2.0 ** -40, -(1.0 + 2.0 ** -52), 1e-300, 5e-324, 1e300]
    out = []
    for v in picks:
        if source == "float32":  # the binary32 nearest (overflow to inf): what a float32 tensor holds
            v = struct.unpack("<f", struct.pack("<f", v))[0] if abs(v) < 3.4028235677973366e38 or \
                not math.isfinite(v) else math.copysign(float("inf"), v)
        out += [v] * 4  # four words each: up and down both occur
    return out


def _case(seed: int, source: str, name: str) -> dict:
    k = keyinit.key(seed)
    values = _inputs(source, name)
    shape = (len(values) // 4, 4)
    expected = [_spec_round(v, word(k.words, i), name) for i, v in enumerate(values)]
    return {"seed": seed, "source": source, "target": name, "shape": list(shape),
            "input_bits": [f"{_bits_of(v, source):x}" for v in values],
            "expected_bits": [f"{b:x}" for b in expected]}


CASES = [(seed, source, name) for seed in (0, 1234567) for source in SOURCES for name in FORMATS]


def _golden() -> dict:
    return json.loads(GOLDEN.read_text())


def _tensor(case: dict) -> torch.Tensor:
    dtype = SOURCES[case["source"]]
    values = [_value_of(int(b, 16), case["source"]) for b in case["input_bits"]]
    return torch.tensor(values, dtype=dtype).reshape(case["shape"])


def _result_bits(result: torch.Tensor) -> list[int]:
    width = result.element_size() * 8
    raw = result.contiguous().view(torch.int16 if width == 16 else torch.uint8).to(torch.int64).reshape(-1)
    return [int(b) & ((1 << width) - 1) for b in raw]


def test_the_golden_file_is_what_the_spec_text_gives():
    cases = _golden()["cases"]
    assert [(c["seed"], c["source"], c["target"]) for c in cases] == CASES
    for case in cases:
        k = keyinit.key(case["seed"])
        for i, (bits, expected) in enumerate(zip(case["input_bits"], case["expected_bits"])):
            value = _value_of(int(bits, 16), case["source"])
            assert _spec_round(value, word(k.words, i), case["target"]) == int(expected, 16), (case["target"], i)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{s}-{src}-{n}" for s, src, n in CASES])
def test_the_implementation_gives_the_golden_bits(index):
    case = _golden()["cases"][index]
    x = _tensor(case)
    dtype = getattr(torch, case["target"])
    whole = stochastic_round(keyinit.key(case["seed"]), x, dtype)
    assert _result_bits(whole) == [int(b, 16) for b in case["expected_bits"]]
    # any region gives the same elements' bits: rows reversed, a column subset
    rows = list(range(x.shape[0]))[::-1]
    part = stochastic_round(keyinit.key(case["seed"]), x[rows][:, [3, 1]], dtype,
                            global_shape=x.shape, region=(rows, [3, 1]))
    assert _result_bits(part) == _result_bits(whole[rows][:, [3, 1]])


def test_section_17_4_example():
    k = keyinit.key(0)
    assert [word(k.words, j) for j in range(4)] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    x = torch.full((4,), 1 + 2.0 ** -9)
    assert x.view(torch.int32)[0].item() == 0x3F804000
    assert stochastic_round(k, x, torch.bfloat16).tolist() == [1.0, 1.0078125, 1.0, 1.0]


def test_the_bf16_bits_rule_of_17_2():
    """'binary32 to bfloat16, as bits': the high 16 bits of the word added to the low 16 bits of the input."""
    k = keyinit.key(99)
    u = keyinit.random.bits(keyinit.key(5), (4096,))  # arbitrary binary32 patterns, finite ones kept
    u = u[((u >> 23) & 0xFF) != 0xFF]
    x = (torch.where(u >= 2**31, u - 2**32, u)).to(torch.int32).view(torch.float32)
    words = keyinit.random.bits(k, (x.numel(),))
    up = ((words >> 16) + (u & 0xFFFF)) >= 2**16
    expected = (u >> 31 << 15) | (((u & 0x7FFFFFFF) >> 16) + up.to(torch.int64))
    assert _result_bits(stochastic_round(k, x, torch.bfloat16)) == expected.tolist()


if __name__ == "__main__":  # writes the golden file from the spec text (run once; never to make a test pass)
    GOLDEN.write_text(json.dumps({
        "comment": "docs/spec.md section 17 (keyed stochastic rounding), computed from the text by "
                   "tests/sround/test_sround_golden.py's _spec_round; bits in hex, row-major",
        "cases": [_case(*c) for c in CASES]}, indent=1) + "\n")
