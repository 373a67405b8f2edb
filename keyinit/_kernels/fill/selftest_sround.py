"""Golden self-test of the compiled stochastic rounding (``keyinit_sround``), run when the fill library loads.

Like :mod:`keyinit._kernels.fill.selftest`: the kernel rounds the cases below and the SHA-256 digests of
its outputs must be :data:`GOLDEN`, the bytes the reference (:mod:`keyinit._draw.reference_sround`)
produces; ``tests/kernels/test_sround_kernel.py`` recomputes them from the reference. The inputs are every
kind of binary32 value (spread bit patterns: NaNs with payloads, infinities, subnormals, zeros of both
signs, values near each target's largest finite value and below its smallest subnormal), rounded to
each target: a dense run, a transposed destination, strided and listed regions, a run off a Philox
block boundary and two threads. FP4 E2M1 (17.7, ``keyinit_sround``'s binary64 target) has its own cases,
:data:`GOLDEN_FP4`: every kind of binary64 quotient (zeros, subnormals, each E2M1 value, the midpoints
and neighbours between them, values that round to 0 or 0.5 only, 6 and past it, infinities; no NaN,
which the caller refuses) over the same layouts.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from keyinit._kernels.fill.selftest import KEY_WORDS, digest

__all__ = ["GOLDEN", "GOLDEN_ADAM", "GOLDEN_FP4", "cases", "adam_cases", "adam_inputs", "fp4_cases", "fp4_inputs",
           "inputs", "run", "run_adam", "run_fp4"]

#: binary32 bit patterns every case starts with: the edge values of section 17.2.
EDGES = (
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x00000001,
    0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x477FE000, 0x477FF000,
    0xC77FEFFF, 0x43E00000, 0x43E80000, 0x47600000, 0x38800000, 0x387FFFFF, 0x33800000, 0x337FFFFF,
    0x3B800000, 0x3A7FFFFF, 0x2F800000, 0x3F804000, 0xBF804000, 0x3F800001, 0x3F80FFFF,
)


def inputs(n: int) -> torch.Tensor:
    """``n`` binary32 values: :data:`EDGES`, then bit patterns spread over all 2**32 (a Weyl sequence)."""
    spread = (torch.arange(n, dtype=torch.int64, device="cpu") * 0x9E3779B9 + 0x7F4A7C15) & 0xFFFFFFFF
    spread[: min(n, len(EDGES))] = torch.tensor(EDGES[:n], dtype=torch.int64, device="cpu")
    return torch.where(spread >= 2**31, spread - 2**32, spread).to(torch.int32).view(torch.float32)


def cases() -> list[tuple[str, torch.dtype, tuple[int, ...], Optional[tuple], str, int]]:
    """``(name, target dtype, global shape, region, layout, threads)`` of every case."""
    return [
        ("sround-bf16-dense", torch.bfloat16, (1031,), None, "dense", 1),
        ("sround-bf16-off-block", torch.bfloat16, (7, 300), (slice(None), slice(3, 290)), "dense", 1),
        ("sround-f16-transposed", torch.float16, (37, 29), (slice(1, None, 2), slice(None)), "transposed", 1),
        ("sround-f16-listed", torch.float16, (37, 29), ([36, 0, 5, 5, 11], slice(None, None, -1)), "dense", 1),
        ("sround-e5m2-strided", torch.float8_e5m2, (40, 50), (slice(None, None, 3), slice(1, None, 2)), "dense", 1),
        ("sround-e4m3fn", torch.float8_e4m3fn, (777,), None, "dense", 1),
        ("sround-bf16-two-threads", torch.bfloat16, (70001,), None, "dense", 2),
        ("sround-f16-two-threads", torch.float16, (70001,), None, "dense", 2),
    ]


#: sha256(output bytes)[:16] of each case, as the reference produces them.
GOLDEN = {
    "sround-bf16-dense": "8ce309cb18295b77",
    "sround-bf16-off-block": "096a7635477dffe2",
    "sround-f16-transposed": "5f47f5214b87256b",
    "sround-f16-listed": "c9c70fe79709a673",
    "sround-e5m2-strided": "d27692007b84378d",
    "sround-e4m3fn": "3b1ad1bd3c5cf454",
    "sround-bf16-two-threads": "2f796399a665cae5",
    "sround-f16-two-threads": "34b8d5abeb24d331",
}


def _empty(shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> torch.Tensor:
    if layout == "transposed":
        return torch.zeros(tuple(reversed(shape)), dtype=dtype, device="cpu").t()
    return torch.zeros(shape, dtype=dtype, device="cpu")


def run(sround: Callable[[torch.Tensor, torch.Tensor, Any, Any, int], bool]) -> list[str]:
    """Names of the cases whose digest is not :data:`GOLDEN` (empty: all pass).

    ``sround(out, x, key, region, threads)`` is the implementation under test.
    """
    from keyinit.keys import Key
    from keyinit.regions import make_region

    key = Key(*KEY_WORDS)
    failed = []
    for name, dtype, shape, region, layout, threads in cases():
        reg = make_region(shape, region)
        x = inputs(reg.numel).reshape(reg.region_shape)
        out = _empty(reg.region_shape, dtype, layout)
        if not sround(out, x, key, reg, threads) or digest(out) != GOLDEN.get(name):
            failed.append(name)
    return failed


#: decay, w, beta2, s2, bc2s, eps, neg_step and has_decay: AdamW's third step (w < 0.5), and w >= 0.5.
ADAM_SCALARS = (
    ([1 - 1e-3, 0.1, 0.999, 1 - 0.999, (1 - 0.999 ** 3) ** 0.5, 1e-8, -1e-2 / (1 - 0.9 ** 3)], True),
    ([1.0, 0.7, 0.5, 0.5, 0.9, 1e-6, -0.3], False),
)


def _finite(n: int, salt: int, fields: int, signed: bool = True) -> torch.Tensor:
    """``n`` finite binary32 values, exponent fields ``1 .. fields`` (a Weyl sequence of bit patterns)."""
    spread = (torch.arange(n, dtype=torch.int64, device="cpu") * 0x9E3779B9 + salt) & 0xFFFFFFFF
    field = ((spread >> 23) & 0xFF) % fields + 1
    bits = (spread & (0x807FFFFF if signed else 0x007FFFFF)) | (field << 23)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def adam_inputs(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Parameter (``dtype``), gradient (``dtype``, below 2 in magnitude), and float32 moments."""
    p = _finite(n, 0x7F4A7C15, 254).to(dtype)
    g = _finite(n, 0x1234567, 127).to(dtype)
    m = _finite(n, 0x2545F491, 120)
    v = _finite(n, 0x6A09E667, 120, signed=False)
    g[::11] = 0
    m[::7] = 0
    return p, g, m, v


def adam_cases() -> list[tuple[str, torch.dtype, tuple[int, ...], Optional[tuple], int, int]]:
    """``(name, parameter dtype, global shape, region, scalars index, threads)`` of every fused Adam case."""
    return [
        ("adam-bf16-dense", torch.bfloat16, (1031,), None, 0, 1),
        ("adam-f16-off-block", torch.float16, (9, 300), (slice(2, 7), slice(3, 290)), 1, 1),
        ("adam-f32-dense", torch.float32, (517,), None, 1, 1),
        ("adam-bf16-two-threads", torch.bfloat16, (70001,), None, 0, 2),
    ]


#: sha256(parameter, exp_avg, exp_avg_sq bytes after the step)[:16], as the reference produces them.
GOLDEN_ADAM = {
    "adam-bf16-dense": "1ccdebb607b6c56d",
    "adam-f16-off-block": "52a05809af0846bd",
    "adam-f32-dense": "0b6719542ae10eca",
    "adam-bf16-two-threads": "5e65580fb11b6571",
}


def adam_digest(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> str:
    return digest(torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in (p, m, v)]))


def run_adam(adam: Callable[..., bool]) -> list[str]:
    """Names of the fused Adam cases whose digest is not :data:`GOLDEN_ADAM` (empty: all pass).

    ``adam(param, grad, exp_avg, exp_avg_sq, key, region, scalars, has_decay, threads)`` is under test.
    """
    from keyinit.keys import Key
    from keyinit.regions import make_region

    key = Key(*KEY_WORDS)
    failed = []
    for name, dtype, shape, region, which, threads in adam_cases():
        reg = make_region(shape, region)
        p, g, m, v = (t.reshape(reg.region_shape) for t in adam_inputs(reg.numel, dtype))
        scalars, has_decay = ADAM_SCALARS[which]
        if not adam(p, g, m, v, key, reg, scalars, has_decay, threads) or adam_digest(p, m, v) != GOLDEN_ADAM.get(name):
            failed.append(name)
    return failed


#: binary64 bit patterns every FP4 case starts with: zeros, subnormals and the smallest normal, values that
#: round to 0 or 0.5 only (R = 0 and R = 1 below 0.5), each E2M1 value, the midpoints between them and
#: their neighbours, the largest value below 6, 6, the binade past it, the largest finite, infinities.
EDGES_FP4 = (
    0x0000000000000000, 0x8000000000000000, 0x0000000000000001, 0x800FFFFFFFFFFFFF, 0x0010000000000000,
    0x3DD0000000000000, 0x3DE0000000000000, 0xBDE0000000000001, 0x3FCFFFFFFFFFFFFF, 0x3FD0000000000000,
    0x3FDFFFFFFFFFFFFF, 0x3FE0000000000000, 0xBFE0000000000001, 0x3FE8000000000000, 0x3FEFFFFFFFFFFFFF,
    0x3FF0000000000000, 0x3FF4000000000000, 0xBFF8000000000000, 0x3FFC000000000000, 0x3FFFFFFFFFFFFFFF,
    0x4000000000000000, 0x4004000000000000, 0xC008000000000000, 0x400C000000000000, 0x4010000000000000,
    0x4014000000000000, 0x4017FFFFFFFFFFFF, 0xC017FFFFFFFFFFFF, 0x4018000000000000, 0x401C000000000000,
    0x4020000000000000, 0x7FEFFFFFFFFFFFFF, 0x7FF0000000000000, 0xFFF0000000000000, 0x3FF0000000000001,
)


def fp4_inputs(n: int) -> torch.Tensor:
    """``n`` binary64 values: :data:`EDGES_FP4`, then bit patterns spread over all 2**64 (NaN patterns moved
    to finite ones), every third in [-8, 8) (the E2M1 range's exponents)."""
    k = torch.arange(n, dtype=torch.int64, device="cpu")
    spread = k * -7046029254386353131 + 0x7F4A7C159E3779B9  # a Weyl sequence, wrapping in int64
    spread = torch.where((spread & 0x7FF0000000000000) == 0x7FF0000000000000, spread & ~(1 << 62), spread)
    near = (spread & ~(0x7FF << 52)) | (((spread >> 52) & 7) + 1018 << 52)  # exponents 2**-5 .. 2**2
    spread = torch.where(k % 3 == 0, near, spread)
    edges = torch.tensor([b - (1 << 64) if b >= 1 << 63 else b for b in EDGES_FP4[:n]], dtype=torch.int64,
                         device="cpu")
    spread[: len(edges)] = edges
    return spread.view(torch.float64)


def fp4_cases() -> list[tuple[str, tuple[int, ...], Optional[tuple], str, int]]:
    """``(name, global shape, region, layout, threads)`` of every FP4 case."""
    return [
        ("fp4-dense", (1031,), None, "dense", 1),
        ("fp4-off-block", (7, 300), (slice(None), slice(3, 290)), "dense", 1),
        ("fp4-transposed", (37, 29), (slice(1, None, 2), slice(None)), "transposed", 1),
        ("fp4-listed", (37, 29), ([36, 0, 5, 5, 11], slice(None, None, -1)), "dense", 1),
        ("fp4-strided", (40, 50), (slice(None, None, 3), slice(1, None, 2)), "dense", 1),
        ("fp4-two-threads", (70001,), None, "dense", 2),
    ]


#: sha256(output codes)[:16] of each FP4 case, as the reference produces them.
GOLDEN_FP4 = {
    "fp4-dense": "d84dc5b0ae361a3f",
    "fp4-off-block": "c083056367f871bc",
    "fp4-transposed": "dc9133461fd6808c",
    "fp4-listed": "eab7eb7531bc1f76",
    "fp4-strided": "99d004e524adc52f",
    "fp4-two-threads": "85705d9b557f5e2d",
}


def run_fp4(sround_fp4: Callable[[torch.Tensor, torch.Tensor, Any, Any, int], bool]) -> list[str]:
    """Names of the FP4 cases whose digest is not :data:`GOLDEN_FP4` (empty: all pass).

    ``sround_fp4(out, v, key, region, threads)`` is the implementation under test.
    """
    from keyinit.keys import Key
    from keyinit.regions import make_region

    key = Key(*KEY_WORDS)
    failed = []
    for name, shape, region, layout, threads in fp4_cases():
        reg = make_region(shape, region)
        v = fp4_inputs(reg.numel).reshape(reg.region_shape)
        out = _empty(reg.region_shape, torch.uint8, layout)
        if not sround_fp4(out, v, key, reg, threads) or digest(out) != GOLDEN_FP4.get(name):
            failed.append(name)
    return failed
