"""convert.h, the one binary32 -> bfloat16 / float16 conversion of the C kernels.

The init kernel and the dropout kernel each had their own conversion before
convert.h (the init kernel the FP16 library's ``fp16_ieee_from_fp32_value``, the
dropout kernel a bit-select formulation). The one kept must give the bits BOTH
gave, for every input, NaNs included: both libraries' exports are checked here
against numpy transcriptions of the two former formulations, on a structured
sample of a few million bit patterns (every float32 pattern with
``KEYINIT_EXHAUSTIVE=1``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from keyinit._kernels.fill import cpu as _cpu
from keyinit._kernels.dropout import cpu as _dropout_cpu

_ON_CI = os.environ.get("CI", "").lower() == "true"
_FILL = _cpu.unchecked_library()
_DROPOUT = _dropout_cpu.unchecked_library()
pytestmark = pytest.mark.skipif((_FILL is None or _DROPOUT is None) and not _ON_CI,
                                reason="the compiled CPU kernels are unavailable")

_BF16, _F16 = 2, 3  # the dtype ids keyinit_convert_f32 takes
U32 = np.uint32


def _f32(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float32)


def _bf16_bits(bits: np.ndarray) -> np.ndarray:
    """c10's round_to_nearest_even on the bits, NaN -> 0x7FC0 (both kernels' former formula)."""
    rounded = (bits + (((bits >> U32(16)) & U32(1)) + U32(0x7FFF))) >> U32(16)
    return np.where(np.isnan(_f32(bits)), U32(0x7FC0), rounded).astype(np.uint16)


def _f16_fp16_library(bits: np.ndarray) -> np.ndarray:
    """The init kernel's former f32_to_f16: fp16_ieee_from_fp32_value (binary32 arithmetic)."""
    with np.errstate(over="ignore", invalid="ignore"):
        base = (_f32(bits & U32(0x7FFFFFFF)) * np.float32(2.0**112)) * np.float32(2.0**-110)
        shl1 = bits + bits
        sign = bits & U32(0x80000000)
        bias = np.maximum(shl1 & U32(0xFF000000), U32(0x71000000))
        base = _f32((bias >> U32(1)) + U32(0x07800000)) + base
    out = base.view(np.uint32)
    nonsign = ((out >> U32(13)) & U32(0x7C00)) + (out & U32(0x0FFF))
    return ((sign >> U32(16)) | np.where(shl1 > U32(0xFF000000), U32(0x7E00), nonsign)).astype(np.uint16)


def _f16_bit_select(bits: np.ndarray) -> np.ndarray:
    """The dropout kernel's former kd_f32_to_f16: every case computed, one selected."""
    sign = (bits >> U32(16)) & U32(0x8000)
    a = bits & U32(0x7FFFFFFF)
    normal = (a + U32(0x0FFF) + ((a >> U32(13)) & U32(1)) - U32(0x38000000)) >> U32(13)
    with np.errstate(over="ignore", invalid="ignore"):
        subnormal = (_f32(a) * np.float32(2.0**24) + np.float32(2.0**23)).view(np.uint32) - U32(0x4B000000)
    out = np.where(a >= U32(0x38800000), normal, subnormal)
    out = np.where(a >= U32(0x477FF000), U32(0x7C00), out)
    out = np.where(a > U32(0x7F800000), U32(0x7E00), out)
    return (sign | out).astype(np.uint16)


def _sample() -> np.ndarray:
    """A stride through all 2**32 patterns, dense runs at every rounding edge, NaN payloads, both signs."""
    sweep = np.arange(0, 2**32, 1021, dtype=np.uint64).astype(np.uint32)
    edges = []
    for center in (65504.0, 65520.0, 2.0**-14, 2.0**-24, 2.0**-25, 1.0, 3.0e38, 2.0**-126, 2.0**-149):
        c = int(np.float32(center).view(np.uint32))
        edges.append(np.arange(max(c - 20000, 0), min(c + 20000, 0x7F800000), dtype=np.uint32))
    edges.append(np.arange(0, 70000, dtype=np.uint32))  # zero and float32 subnormals
    edges.append(np.arange(0x7F7F0000, 0x7F810000, dtype=np.uint32))  # the largest floats, inf, NaNs
    nans = np.array([0x7FC00000, 0x7FFFFFFF, 0x7F800001, 0x7FA00000, 0x7FC00001], dtype=np.uint32)
    bits = np.concatenate([sweep, *edges, nans])
    return np.concatenate([bits, bits | U32(0x80000000)])


def _check(bits: np.ndarray) -> None:
    bits = np.ascontiguousarray(bits, dtype=np.uint32)
    src = torch.from_numpy(bits.view(np.float32))
    n = src.numel()
    bf16 = torch.empty(n, dtype=torch.int16)
    f16 = torch.empty(n, dtype=torch.int16)
    _FILL.keyinit_convert_f32(src.data_ptr(), n, _BF16, bf16.data_ptr())
    _FILL.keyinit_convert_f32(src.data_ptr(), n, _F16, f16.data_ptr())
    half = torch.empty(n, dtype=torch.int16)
    back = torch.empty(n, dtype=torch.float32)
    _DROPOUT.keyinit_dropout_f16_roundtrip(src.data_ptr(), n, half.data_ptr(), back.data_ptr())
    expected_bf16 = _bf16_bits(bits)
    expected_f16 = _f16_fp16_library(bits)
    assert np.array_equal(_f16_bit_select(bits), expected_f16), "the two former formulations disagree"
    assert np.array_equal(bf16.numpy().view(np.uint16), expected_bf16)
    assert np.array_equal(f16.numpy().view(np.uint16), expected_f16)
    assert np.array_equal(half.numpy().view(np.uint16), expected_f16)
    # float16 -> float32 is exact: the round trip is numpy's own widening
    assert np.array_equal(back.numpy().view(np.uint32), expected_f16.view(np.float16).astype(np.float32).view(np.uint32))


def test_one_conversion_gives_both_former_kernels_bits():
    bits = _sample()
    assert bits.size > 8_000_000
    _check(bits)


def test_nan_bits_are_pinned():
    bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], dtype=np.uint32)
    assert _bf16_bits(bits).tolist() == [0x7FC0, 0x7FC0, 0x7FC0, 0x7FC0]
    assert _f16_fp16_library(bits).tolist() == [0x7E00, 0xFE00, 0x7E00, 0xFE00]
    _check(bits)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KEYINIT_EXHAUSTIVE"), reason="set KEYINIT_EXHAUSTIVE=1 for the 2**32 sweep")
def test_one_conversion_gives_both_former_kernels_bits_exhaustively():
    chunk = 1 << 24
    for start in range(0, 1 << 32, chunk):
        _check(np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32))
