"""docs/spec.md 17.7 (keyed stochastic rounding to FP4 E2M1 given a scale) recomputed from its text alone,
its golden vectors, and ``keyinit.random.stochastic_round_fp4``: the golden bits for whole tensors and
regions, torchao's E2M1 codes for representable quotients and a neighbour of the quotient otherwise,
unbiased, and the errors it names.

``_spec_round`` is an independent implementation in exact rational arithmetic (E2M1's values from 17.1's
formula, ``lo`` by bisection, ``x + floor((a - lo) * 2**32 / q) >= 2**32``) on the words of section 4's
Philox (:func:`tests.sround.test_sround_golden.word`). ``tests/sround/golden_sround_fp4_v1.json`` was written once by
``python -m tests.sround.test_sround_fp4`` from ``_spec_round`` (never from the implementation).
"""

from __future__ import annotations

import bisect
import json
import math
import struct
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import keyinit
from keyinit.random import stochastic_round_fp4
from tests.sround.test_sround_golden import word

GOLDEN = Path(__file__).with_name("golden_sround_fp4_v1.json")
P, EMIN, EMAX, LARGEST = 2, 0, 2, 0x7
#: 17.1's formula for p = 2, emin = 0, up to the binade past emax: 0, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12
VALUES = [Fraction(t, 2) if f == 0 else (2 + t) * Fraction(2) ** (f - 1 + EMIN - P + 1)
          for f in range(EMAX - EMIN + 3) for t in range(2)]
SOURCES = {"float32": torch.float32, "float64": torch.float64}


def _spec_round(x_value: float, scale: float, word_x: int) -> int:
    """17.7 for one element: the E2M1 code of ``x_value / scale`` (the binary64 quotient) with word ``word_x``."""
    if scale == 0:  # IEEE: a nonzero finite x over a zero scale is an infinity of the quotient's sign
        v = math.copysign(float("inf"), x_value) * math.copysign(1.0, scale)
    else:
        v = x_value / scale  # Python floats: IEEE binary64 division, correctly rounded
    assert not math.isnan(v)
    sign = 0x8 if math.copysign(1.0, v) < 0 else 0
    if math.isinf(v):
        return sign | LARGEST
    a = abs(Fraction(v))
    if a >= Fraction(2) ** (EMAX + 1):
        return sign | LARGEST
    index = bisect.bisect_right(VALUES, a) - 1
    lo, hi = VALUES[index], VALUES[index + 1]
    r = math.floor((a - lo) * 2**32 / (hi - lo))
    bits = index + (1 if word_x + r >= 2**32 else 0)
    return sign | min(bits, LARGEST)


def _f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0] if abs(v) < 3.4e38 or not math.isfinite(v) else \
        math.copysign(float("inf"), v)


def _inputs(source: str) -> list[tuple[float, float]]:
    """(x, scale) pairs reaching every clause: representable, between, negative, zeros, below the smallest
    step, near and past 6, infinities, zero scales, power-of-two and other scales (an inexact quotient)."""
    picks = [(1.0, 1.0), (-1.5, 1.0), (0.0, 2.0), (-0.0, 0.25), (2.4, 1.0), (-2.4, 1.0), (0.3, 1.0),
             (5.5, 1.0), (6.0, 1.0), (6.9, 1.0), (-100.0, 1.0), (7.0, 0.5), (3.0, 4.0), (1.0, 3.0),
             (0.7, 0.3), (1e-10, 1.0), (2.0 ** -34, 1.0), (float("inf"), 1.0), (float("-inf"), 2.0),
             (1.0, 0.0), (-1.0, 0.0), (1e-30, 2.0 ** -100), (3.3, 0.1), (math.pi, 0.5)]
    return [((_f32(x) if source == "float32" else x), s) for x, s in picks]


def _case(seed: int, source: str) -> dict:
    k = keyinit.key(seed)
    pairs = [p for p in _inputs(source) for _ in range(4)]  # four words each: up and down both occur
    expected = [_spec_round(x, s, word(k.words, i)) for i, (x, s) in enumerate(pairs)]
    fmt, width = ("<f", "<I") if source == "float32" else ("<d", "<Q")
    return {"seed": seed, "source": source, "shape": [len(pairs) // 4, 4],
            "input_bits": [f"{struct.unpack(width, struct.pack(fmt, x))[0]:x}" for x, _ in pairs],
            "scale_float64_bits": [f"{struct.unpack('<Q', struct.pack('<d', s))[0]:x}" for _, s in pairs],
            "expected_codes": [f"{b:x}" for b in expected]}


CASES = [(seed, source) for seed in (0, 1234567) for source in SOURCES]


def _golden() -> dict:
    return json.loads(GOLDEN.read_text())


def _tensors(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    fmt, width = ("<f", "<I") if case["source"] == "float32" else ("<d", "<Q")
    x = [struct.unpack(fmt, struct.pack(width, int(b, 16)))[0] for b in case["input_bits"]]
    s = [struct.unpack("<d", struct.pack("<Q", int(b, 16)))[0] for b in case["scale_float64_bits"]]
    return (torch.tensor(x, dtype=SOURCES[case["source"]]).reshape(case["shape"]),
            torch.tensor(s, dtype=torch.float64).reshape(case["shape"]))


def test_the_golden_file_is_what_the_spec_text_gives():
    cases = _golden()["cases"]
    assert [(c["seed"], c["source"]) for c in cases] == CASES
    for case in cases:
        assert case == _case(case["seed"], case["source"])


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{s}-{src}" for s, src in CASES])
def test_the_implementation_gives_the_golden_codes(index):
    case = _golden()["cases"][index]
    x, scale = _tensors(case)
    k = keyinit.key(case["seed"])
    whole = stochastic_round_fp4(k, x, scale)
    assert whole.dtype == torch.uint8 and whole.reshape(-1).tolist() == [int(b, 16) for b in case["expected_codes"]]
    rows = list(range(x.shape[0]))[::-1]  # a region: rows reversed, a column subset
    part = stochastic_round_fp4(k, x[rows][:, [3, 1]], scale[rows][:, [3, 1]], global_shape=x.shape,
                                region=(rows, [3, 1]))
    assert torch.equal(part, whole[rows][:, [3, 1]])
    out = torch.empty(x.shape[1], x.shape[0], dtype=torch.uint8).t()  # into a transposed out
    assert stochastic_round_fp4(k, x, scale, out=out) is out and torch.equal(out, whole)


def test_torchao_codes_and_neighbours():
    f4 = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    k = keyinit.key(3)
    x = keyinit.random.normal(keyinit.key(4), (64, 32), std=3.0)
    scale = torch.exp2(torch.randint(-3, 3, (64, 1)).float())  # MX: a power of two per block of 32
    codes = stochastic_round_fp4(k, x, scale)
    v = x / scale
    down = f4.f32_to_f4_unpacked(v.sign() * VALUES_T[torch.bucketize(v.abs(), VALUES_T, right=True) - 1])
    decoded = f4.f4_unpacked_to_f32(codes)
    lo = f4.f4_unpacked_to_f32(down)
    assert ((decoded == lo) | ((decoded.abs() > lo.abs()) & (decoded.abs() - lo.abs() <= 2.0))).all()
    assert ((decoded.abs() >= v.abs()) | (decoded == lo)).all() and (decoded.abs() <= 6).all()
    exact = f4.f4_unpacked_to_f32(torch.arange(16, dtype=torch.uint8)).reshape(1, 16) * scale[:16]
    assert torch.equal(stochastic_round_fp4(k, exact, scale[:16]), f4.f32_to_f4_unpacked(exact / scale[:16]))


VALUES_T = torch.tensor([float(v) for v in VALUES[:9]])


def test_unbiased():
    """E[decoded] = v for values between neighbours (one key, many elements: independent words)."""
    table = torch.tensor([float(v) for v in VALUES[:8]] * 2) * torch.tensor([1.0] * 8 + [-1.0] * 8)
    for v, (lo, hi) in ((2.4, (2.0, 3.0)), (-0.3, (0.0, 0.5)), (5.0, (4.0, 6.0))):
        n = 200_000
        codes = stochastic_round_fp4(keyinit.key(11), torch.full((n,), v), 1.0)
        decoded = table[codes.long()]
        p = (abs(v) - lo) / (hi - lo)
        se = (hi - lo) * math.sqrt(p * (1 - p) / n)
        assert abs(decoded.mean().item() - v) < 5 * se, v
        assert set(decoded.abs().unique().tolist()) == {lo, hi}


def test_errors_name_what_is_wrong():
    k = keyinit.key(0)
    with pytest.raises(ValueError, match=r"x / scale has NaN elements .* E2M1 has no NaN"):
        stochastic_round_fp4(k, torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"scale of shape \(3,\) does not broadcast to x's local shape \(2, 2\)"):
        stochastic_round_fp4(k, torch.ones(2, 2), torch.ones(3))
    with pytest.raises(TypeError, match="x must be float32 or float64, got torch.bfloat16"):
        stochastic_round_fp4(k, torch.ones(2, dtype=torch.bfloat16), 1.0)
    with pytest.raises(TypeError, match="out has dtype torch.float32 but dtype=torch.uint8"):
        stochastic_round_fp4(k, torch.ones(2), 1.0, out=torch.empty(2))


if __name__ == "__main__":  # writes the golden file from the spec text (run once; never to make a test pass)
    GOLDEN.write_text(json.dumps({
        "comment": "docs/spec.md 17.7 (keyed stochastic rounding to FP4 E2M1 given a scale), computed from the "
                   "text by tests/sround/test_sround_fp4.py's _spec_round; codes in hex, row-major",
        "cases": [_case(*c) for c in CASES]}, indent=1) + "\n")
