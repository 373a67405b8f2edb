"""Bit-reproducible float32 transforms used by stream v1.

Library ``log``/``erfinv`` differ in the last ulp between libm, Sleef, CUDA's
libdevice and torch's vectorized body vs. scalar tail. Every function here is
instead a fixed sequence of IEEE-754 binary32 operations that are correctly
rounded everywhere (``+ - * /``, ``sqrt``, comparisons, and exact bit
manipulation), evaluated in the order written, with no fused multiply-add.
Any implementation that performs the same operations in the same order, in
binary32 with round-to-nearest-even and without flushing subnormals,
reproduces the same bits. ``docs/spec.md`` lists the constants as bit patterns.

All inputs and outputs are float32 tensors.
"""

from __future__ import annotations

import math

import torch

__all__ = ["f32", "sqrt_f32", "log_f32", "ndtri_tail_f32", "ndtri_f32", "V1_CONSTANTS"]


def f32(value: float) -> float:
    """``value`` rounded to the nearest binary32 (ties to even), returned as a Python float.

    Computed with integer arithmetic and exact power-of-two scalings, never with a
    hardware double-to-float conversion: a process that turned on flush-to-zero
    (``torch.set_flush_denormal(True)``, a library built with ``-ffast-math``) would
    flush binary32 subnormals in that conversion. Same results as
    ``struct.pack("<f", value)`` otherwise, including ``OverflowError`` for a
    finite value that rounds past the largest binary32.
    """
    value = float(value)
    if value == 0.0 or not math.isfinite(value):
        return value
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    bits = min(24, exponent + 149)  # significant bits kept: 24, fewer for subnormals (ulp 2**-149)
    if bits < 0:  # below half the smallest subnormal
        return math.copysign(0.0, value)
    shift = 53 - bits
    kept, dropped = divmod(int(abs(mantissa) * 2.0**53), 1 << shift)  # exact: 53-bit integer mantissa
    half = 1 << (shift - 1)
    if dropped > half or (dropped == half and kept & 1):
        kept += 1
    if kept and exponent - bits + kept.bit_length() > 128:
        raise OverflowError("float too large to pack with f format")
    return math.copysign(math.ldexp(kept, exponent - bits), value)


# log: ln(x) = e*ln2 + 2*atanh(s), s = (m - 1) / (m + 1), m in [sqrt(1/2), sqrt(2)).
SQRT2 = f32(1.4142135623730951)
LN2_HI = f32(0.693145751953125)  # 0x3f317200: 16 significant bits, so e * LN2_HI is exact
LN2_LO = f32(1.4286068203094173e-06)
LOG_ATANH = tuple(f32(1.0 / n) for n in (3, 5, 7, 9))

# Wichura, "Algorithm AS 241" (Applied Statistics 37, 1988), PPND7: about 1e-7 relative.
PPND_SPLIT_CENTRAL = f32(0.425)
PPND_CENTRAL_R0 = f32(0.180625)
PPND_A = tuple(f32(c) for c in (3.3871327179, 50.434271938, 159.29113202, 59.109374720))
PPND_B = tuple(f32(c) for c in (1.0, 17.895169469, 78.757757664, 67.187563600))
PPND_SPLIT_TAIL = f32(5.0)
PPND_TAIL_SHIFT = f32(1.6)
PPND_C = tuple(f32(c) for c in (1.4234372777, 2.7568153900, 1.3067284816, 0.17023821103))
PPND_D = tuple(f32(c) for c in (1.0, 0.73700164250, 0.12021132975))
PPND_E = tuple(f32(c) for c in (6.6579051150, 3.0812263860, 0.42868294337, 0.017337203997))
PPND_F = tuple(f32(c) for c in (1.0, 0.24197894225, 0.012258202635))
SMALLEST_NORMAL = 2.0**-126

V1_CONSTANTS: dict[str, object] = {
    name: value
    for name, value in globals().items()
    if name.isupper() and isinstance(value, (float, tuple))
}


def _horner(coefficients: tuple[float, ...], x: torch.Tensor) -> torch.Tensor:
    """``c[0] + x*(c[1] + x*(... + x*c[n]))`` evaluated from the highest term down."""
    acc = torch.full_like(x, coefficients[-1])
    for c in reversed(coefficients[:-1]):
        acc = acc * x + c
    return acc


def sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded binary32 square root of non-negative float32 values.

    ``torch.sqrt`` is not correctly rounded on every build (on x86 CPU builds
    with MKL, about 0.6% of float32 results are 1 ulp off), so the reference
    only takes an estimate from it and then settles the rounding with exact
    arithmetic: for a binary32 candidate ``y`` and its neighbour ``y'``, the
    midpoint ``m = (y + y') / 2`` has at most 25 significant bits, so ``m * m``
    is exact in binary64 and ``x > m*m`` decides exactly which side of the
    midpoint ``sqrt(x)`` lies on (it is never exactly on it). Two steps up and
    two down cover any estimate within 2 ulp.
    """
    xd = x.double()
    y = torch.sqrt(xd).to(torch.float32)
    up_limit = torch.tensor(math.inf, dtype=torch.float32, device=x.device)
    for _ in range(2):
        above = torch.nextafter(y, up_limit)
        mid = (y.double() + above.double()) * 0.5
        y = torch.where(xd > mid * mid, above, y)
    for _ in range(2):
        below = torch.nextafter(y, torch.zeros_like(y))
        mid = (y.double() + below.double()) * 0.5
        y = torch.where((y > 0) & (xd < mid * mid), below, y)
    return y


def log_f32(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 values, to about 1 ulp.

    With ``x = 2**e * m``, ``m`` in ``[1, 2)`` taken from the bits, and ``m``
    halved (``e`` incremented) when ``m > SQRT2``::

        s = (m - 1) / (m + 1)                 # m - 1 is exact (Sterbenz)
        t = s * s
        P = t * (1/3 + t * (1/5 + t * (1/7 + t * 1/9)))
        log m = 2s + 2s * P
        log x = e * LN2_HI + (e * LN2_LO + log m)
    """
    bits = x.view(torch.int32)
    exponent = (bits >> 23) - 127
    mantissa = ((bits & 0x007FFFFF) | 0x3F800000).view(torch.float32)
    halve = mantissa > SQRT2
    mantissa = torch.where(halve, mantissa * 0.5, mantissa)
    e = (exponent + halve.to(torch.int32)).to(torch.float32)
    s = (mantissa - 1.0) / (mantissa + 1.0)
    t = s * s
    poly = t * _horner(LOG_ATANH, t)
    two_s = s * 2.0
    log_m = two_s + two_s * poly
    return e * LN2_HI + (e * LN2_LO + log_m)


def ndtri_tail_f32(tail: torch.Tensor) -> torch.Tensor:
    """``|Phi^-1(t)|`` for a tail probability ``t`` in ``(0, 0.5]`` (PPND7).

    ``q = 0.5 - t``. Central region (``q <= 0.425``)::

        r = 0.180625 - q*q ;  z = q * A(r) / B(r)

    Tails: ``r = sqrt(-log(max(t, 2**-126)))``; if ``r <= 5``, ``z = C(r - 1.6) / D(r - 1.6)``,
    else ``z = E(r - 5) / F(r - 5)``. ``A..F`` are Horner polynomials
    (lowest coefficient first in the tables).
    """
    q = 0.5 - tail
    r_central = PPND_CENTRAL_R0 - q * q
    z_central = q * _horner(PPND_A, r_central) / _horner(PPND_B, r_central)
    r = sqrt_f32(-log_f32(torch.clamp(tail, min=SMALLEST_NORMAL)))
    r_near = r - PPND_TAIL_SHIFT
    z_near = _horner(PPND_C, r_near) / _horner(PPND_D, r_near)
    r_far = r - PPND_SPLIT_TAIL
    z_far = _horner(PPND_E, r_far) / _horner(PPND_F, r_far)
    z_tail = torch.where(r <= PPND_SPLIT_TAIL, z_near, z_far)
    return torch.where(q <= PPND_SPLIT_CENTRAL, z_central, z_tail)


def ndtri_f32(p: torch.Tensor) -> torch.Tensor:
    """``Phi^-1(p)`` for ``p`` in ``[0, 1]``: ``t = min(p, 1 - p)``, sign negative iff ``p < 0.5``."""
    lower = p < 0.5
    magnitude = ndtri_tail_f32(torch.where(lower, p, 1.0 - p))
    return torch.where(lower, -magnitude, magnitude)
