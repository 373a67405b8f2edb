"""Golden self-test of the compiled stochastic rounding (``keyinit_sround``), run when the fill library loads.

Like :mod:`keyinit._kernels.fill.selftest`: the kernel rounds the cases below and the SHA-256 digests of
its outputs must be :data:`GOLDEN`, the bytes the reference (:mod:`keyinit._draw.reference_sround`)
produces; ``tests/test_sround_kernel.py`` recomputes them from the reference. The inputs are every
kind of binary32 value (spread bit patterns: NaNs with payloads, infinities, subnormals, zeros of both
signs, values near each target's largest finite value and below its smallest subnormal), rounded to
each target: a dense run, a transposed destination, strided and listed regions, a run off a Philox
block boundary and two threads.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from keyinit._kernels.fill.selftest import KEY_WORDS, digest

__all__ = ["GOLDEN", "cases", "inputs", "run"]

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
