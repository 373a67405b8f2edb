"""Keyed stochastic rounding of one element: its value's bits and its stream word to the target's bits.

The executable form of ``docs/spec.md`` section 17, in integer operations on bit patterns only (no
floating-point arithmetic, so every backend and ISA gives the same bits). A binary32 or binary64 value
``v`` lies between two neighbours ``lo <= |v| < hi`` of the target format, ``hi - lo = q`` (the target's
quantum at ``lo``); with ``R = floor((|v| - lo) * 2**32 / q)`` and the element's word ``x``, the
magnitude rounds up to ``hi`` iff ``x + R >= 2**32`` (probability ``R / 2**32``). The sign is kept
(sign-magnitude); NaN, infinities and overflow are as the spec says per format.

Decoding ``|v| = m * 2**e`` (``m`` the significand as an integer) and writing ``E`` for the exponent of
``lo``'s binade (``floor(log2 |v|)``, at least the target's ``emin``), ``q = 2**(E - (p - 1))``, so
``lo / q = m >> shift`` and ``|v| - lo = (m mod 2**shift) * 2**e`` with ``shift = E - (p - 1) - e``.
Every intermediate fits int64: ``m < 2**53``, and shift amounts are clamped to 62 (beyond which the
shifted value is 0 anyway).
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["TargetFormat", "TARGETS", "SOURCES", "E2M1", "round_bits", "to_dtype", "check_round_input"]


@attrs.frozen
class TargetFormat:
    """A target of stochastic rounding: ``p`` significand bits (implicit bit included), the smallest
    normal exponent ``emin``, the largest finite exponent ``emax``, the width ``nbits``, the magnitude
    bits of infinity (``None``: the format has none and saturates) and of its NaN, and the largest
    finite magnitude's bits."""

    name: str
    nbits: int
    p: int
    emin: int
    emax: int
    inf: "int | None"
    nan: int
    max_finite: int


#: The targets, by torch dtype (section 17.1's table).
TARGETS: dict[torch.dtype, TargetFormat] = {
    torch.bfloat16: TargetFormat("bfloat16", 16, 8, -126, 127, 0x7F80, 0x7FC0, 0x7F7F),
    torch.float16: TargetFormat("float16", 16, 11, -14, 15, 0x7C00, 0x7E00, 0x7BFF),
    torch.float8_e5m2: TargetFormat("float8_e5m2", 8, 3, -14, 15, 0x7C, 0x7E, 0x7B),
    torch.float8_e4m3fn: TargetFormat("float8_e4m3fn", 8, 4, -6, 8, None, 0x7F, 0x7E),
}

#: FP4 E2M1 (section 17.7: values 0, 0.5, 1, 1.5, 2, 3, 4, 6), which has neither infinity nor NaN: finite
#: overflow and infinities saturate to 6 (its ``nan`` field is the largest finite magnitude, which only an
#: infinite source reaches: a NaN is refused before rounding), as torchao's round-to-nearest cast does.
E2M1 = TargetFormat("float4_e2m1", 4, 2, 0, 2, None, 0x7, 0x7)

#: The sources: (significand bits stored, exponent bits, the int dtype of the same width).
SOURCES: dict[torch.dtype, tuple[int, int]] = {
    torch.float32: (23, 8),
    torch.float64: (52, 11),
}

_MAX_SHIFT = 62


def check_round_input(where: str, x: object, dtype: object) -> None:
    """A ``TypeError`` naming ``where`` unless ``x`` is a float32 or float64 tensor and ``dtype`` a target format."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SOURCES:
        raise TypeError(f"{where}: x must be float32 or float64, got {x.dtype}")
    if dtype not in TARGETS:
        names = ", ".join(str(d) for d in TARGETS)
        raise TypeError(f"{where}: dtype must be one of {names}, got {dtype}")


def _shr(value: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_right_shift(value, amount.clamp(0, _MAX_SHIFT))


def _shl(value: torch.Tensor, amount: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_left_shift(value, amount.clamp(0, _MAX_SHIFT))


def round_bits(x: torch.Tensor, words: torch.Tensor, target: TargetFormat) -> torch.Tensor:
    """The target bit patterns (int64 in ``[0, 2**nbits)``) of ``x`` (float32 or float64) rounded
    stochastically with one word (int64 in ``[0, 2**32)``, shaped like ``x``) per element."""
    mant_bits, exp_bits = SOURCES[x.dtype]
    bias = (1 << (exp_bits - 1)) - 1
    if x.dtype == torch.float32:
        raw = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        sign = raw >> 31
        magnitude = raw & 0x7FFFFFFF
    else:
        raw = x.contiguous().view(torch.int64)
        sign = (raw < 0).to(torch.int64)
        magnitude = raw & 0x7FFFFFFFFFFFFFFF
    field = magnitude >> mant_bits
    fraction = magnitude & ((1 << mant_bits) - 1)
    special = field == (1 << exp_bits) - 1
    m = torch.where(field != 0, fraction | (1 << mant_bits), fraction)
    field = field.clamp(min=1)  # a subnormal source has the smallest normal's exponent
    e = field - (bias + mant_bits)  # |v| = m * 2**e
    big_e = (field - bias).clamp(min=target.emin)  # the exponent of lo's binade
    shift = big_e - (target.p - 1) - e  # >= 1: every source is wider than every target
    units = _shr(m, shift)  # lo / q
    remainder = m - _shl(units, shift)  # (|v| - lo) / 2**e, below 2**shift
    fraction32 = torch.where(shift <= 32, _shl(remainder, 32 - shift), _shr(remainder, shift - 32))  # R
    up = (words + fraction32) >> 32  # 1 iff x + R >= 2**32
    bits = ((big_e - target.emin) << (target.p - 1)) + units + up
    overflow = big_e > target.emax
    if target.inf is None:  # no infinity: finite values saturate, infinities are NaN
        bits = torch.where(overflow | (bits > target.max_finite), target.max_finite, bits)
        bits = torch.where(special, target.nan, bits)
    else:
        bits = torch.where(overflow, target.inf, bits)
        bits = torch.where(special, torch.where(fraction != 0, target.nan, target.inf), bits)
    return bits | (sign << (target.nbits - 1))


def to_dtype(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bit patterns (int64 in ``[0, 2**nbits)``) as a tensor of ``dtype`` holding exactly those bits."""
    nbits = TARGETS[dtype].nbits
    if nbits == 16:
        signed = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)
        return signed.to(torch.int16).view(dtype)
    return bits.to(torch.uint8).view(dtype)
