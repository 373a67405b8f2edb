"""Golden self-test of a compiled CPU kernel, run once when it is loaded.

A library that compiles and loads can still be wrong: a compiler wrapper that
adds value-changing flags, a miscompiled SIMD path, a CPU quirk. Before
:mod:`keyinit._kernels.fill.cpu` uses a library, it fills the cases below with it
and compares SHA-256 digests of the output bytes with :data:`GOLDEN`, which
are the bytes the reference implementation (:mod:`keyinit._draw.reference_fill`)
produces for the same cases; ``tests/kernels/test_kernels_cpu.py`` recomputes them
from the reference, so they cannot drift from the stream.

The cases are small (about 80k elements, a millisecond or two) and cover every
code path whose arithmetic could differ: subnormal outputs (flush-to-zero),
each PPND7 branch (central, near tail, far tail with the 2**-126 clamp), the
bf16/fp16 roundings, two-word elements, runs starting off a Philox block
boundary, strided, reversed and listed regions, flat indices near 2**62, a
transposed destination and two threads.

:data:`NAMED_GOLDEN` does the same for the draws of keyed forwards under stream v2 (``docs/spec.md``
14.8, ``keyinit_fill_high``), the bytes of the reference :func:`keyinit._draw.names.fill_named`: one to
three coordinates, extent-1 dimensions, the sample innermost (high words per element), samples near
``2**31``, two-word elements, a listed region (a lazily evaluated draw's), a transposed destination
and two threads.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import torch

__all__ = ["GOLDEN", "KEY_WORDS", "NAMED_GOLDEN", "cases", "named_cases", "run", "run_named", "run_folded",
           "run_mt_seed"]

#: Key (k0, k1) of every case.
KEY_WORDS = (0x243F6A88, 0x85A308D3)

_BIG = 2**31


def cases() -> list[tuple[str, Any, torch.dtype, tuple[int, ...], Optional[tuple], str, int]]:
    """``(name, dist, dtype, shape, region, layout, threads)`` of every case."""
    from keyinit.distributions import Bernoulli, Bits, Normal, Randint, TruncatedNormal, Uniform

    return [
        ("bits-near-2**62", Bits(), torch.int64, (_BIG, _BIG),
         (slice(_BIG - 2, None), slice(_BIG - 70, None, 3)), "dense", 1),
        ("uniform-subnormal", Uniform.create(0.0, 1e-40), torch.float32, (300,), None, "dense", 1),
        ("uniform-bf16-run", Uniform.create(-1.5, 2.25), torch.bfloat16, (5, 300),
         (slice(None), slice(3, 290)), "dense", 1),
        ("normal-f32", Normal.create(0.25, 2.0), torch.float32, (1031,), None, "dense", 1),
        ("normal-bf16-list", Normal.create(0.0, 1.0), torch.bfloat16, (37, 29),
         ([36, 0, 5, 5, 11], slice(1, None)), "dense", 1),
        ("normal-f16-transposed", Normal.create(1.0, 3e4), torch.float16, (19, 23),
         (slice(1, None, 2), slice(None)), "transposed", 1),
        ("normal-f64-reversed", Normal.create(0.0, 1.0), torch.float64, (9, 70),
         (slice(None, None, -2), slice(None, None, -1)), "dense", 1),
        ("trunc-far-tail", TruncatedNormal.create(0.0, 1.0, -14.0, -13.0, torch.float32), torch.float32,
         (257,), None, "dense", 1),
        ("trunc-flip-bf16", TruncatedNormal.create(1.0, 0.5, 1.2, 9.0, torch.bfloat16), torch.bfloat16,
         (1000,), None, "dense", 1),
        ("bernoulli-bool", Bernoulli.create(0.3), torch.bool, (1000,), None, "dense", 1),
        ("randint-int8", Randint.create(-7, 100, torch.int8), torch.int8, (3, 333),
         (slice(None, None, -1), [7, 3, 300, 301, 302]), "dense", 1),
        ("randint-near-2**62", Randint.create(-(2**31), 2**31, torch.int64), torch.int64, (_BIG, _BIG),
         (slice(_BIG - 1, None), slice(_BIG - 65, None)), "dense", 1),
        ("normal-two-threads", Normal.create(0.0, 1.0), torch.float32, (70001,), None, "dense", 2),
    ]


#: sha256(output bytes)[:16] of each case, as the reference produces them.
GOLDEN = {
    "bits-near-2**62": "9f089be88e07de13",
    "uniform-subnormal": "93ce44ec61834f54",
    "uniform-bf16-run": "ffe9533f6b020480",
    "normal-f32": "7f08fce473f1fe56",
    "normal-bf16-list": "d22d504a63bde8b5",
    "normal-f16-transposed": "284ccfb79fbb9fcc",
    "normal-f64-reversed": "7e9f5c8692e07fdd",
    "trunc-far-tail": "289860281969c0f2",
    "trunc-flip-bf16": "5215f5fed451603e",
    "bernoulli-bool": "8b2bc522f8a9deb1",
    "randint-int8": "4264b7acd624a446",
    "randint-near-2**62": "bd45ac6aa1f7ac71",
    "normal-two-threads": "43e256e94c1f772d",
}


def named_cases() -> list[tuple[str, Any, torch.dtype, tuple[int, ...], Optional[tuple], tuple[int, ...], str,
                                   int]]:
    """``(name, dist, dtype, shape, region, sample_shape, layout, threads)`` of every named case: ``region``
    of the canonical tensor ``shape`` whose samples have ``sample_shape`` (a keyed forward's random op)."""
    from keyinit.distributions import Bernoulli, Normal, Randint, TruncatedNormal, Uniform

    return [
        ("named-normal-f32-extent-1", Normal.create(0.25, 2.0), torch.float32, (7, 5, 1, 130),
         (slice(3, None), slice(None), slice(None), slice(None)), (5, 1, 130), "dense", 1),
        ("named-uniform-bf16-3-coords", Uniform.create(-1.5, 2.25), torch.bfloat16, (2, 3, 4, 9),
         (slice(None),) * 4, (3, 4, 9), "dense", 1),
        ("named-randint-near-2**31", Randint.create(-7, 100, torch.int64), torch.int64, (_BIG, 6, 7),
         (slice(_BIG - 3, None), slice(None), slice(None)), (6, 7), "dense", 1),
        ("named-bernoulli-per-sample", Bernoulli.create(0.3), torch.bool, (40,), (slice(5, None),), (), "dense", 1),
        ("named-normal-f64-listed", Normal.create(0.0, 1.0), torch.float64, (60,),
         ([59, 0, 13, 14, 15, 16, 2, 2, 47],), (4, 3), "dense", 1),
        ("named-trunc-f16-transposed", TruncatedNormal.create(1.0, 0.5, 1.2, 9.0, torch.float16), torch.float16,
         (9, 19), (slice(1, None), slice(None)), (19,), "transposed", 1),
        ("named-uniform-two-threads", Uniform.create(0.0, 1.0), torch.float32, (2, 137, 256), (slice(None),) * 3,
         (137, 256), "dense", 2),
    ]


#: sha256(output bytes)[:16] of each named case, as the reference (keyinit._draw.names.fill_named) gives them.
NAMED_GOLDEN = {
    "named-normal-f32-extent-1": "377ef0bf69feb843",
    "named-uniform-bf16-3-coords": "56302daa335487c6",
    "named-randint-near-2**31": "ee4fd554ade0413c",
    "named-bernoulli-per-sample": "3d8cafb58835b260",
    "named-normal-f64-listed": "1519d997158da54b",
    "named-trunc-f16-transposed": "c38685bc4c2318ee",
    "named-uniform-two-threads": "aa65322da6156be0",
}


def _empty(shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> torch.Tensor:
    if layout == "transposed":
        return torch.zeros(tuple(reversed(shape)), dtype=dtype, device="cpu").t()
    return torch.zeros(shape, dtype=dtype, device="cpu")


def digest(out: torch.Tensor) -> str:
    """SHA-256 (16 hex digits) of ``out``'s values as row-major bytes."""
    dense = torch.empty(out.shape, dtype=out.dtype, device="cpu").copy_(out).reshape(-1)
    return hashlib.sha256(dense.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def run(fill: Callable[[torch.Tensor, Any, Any, Any, int], bool]) -> list[str]:
    """Names of the cases whose digest is not :data:`GOLDEN` (empty: all pass).

    ``fill(out, dist, key, region, threads)`` is the implementation under test.
    """
    from keyinit.keys import Key
    from keyinit.regions import make_region

    key = Key(*KEY_WORDS)
    failed = []
    for name, dist, dtype, shape, region, layout, threads in cases():
        reg = make_region(shape, region)
        out = _empty(reg.region_shape, dtype, layout)
        if not fill(out, dist, key, reg, threads) or digest(out) != GOLDEN.get(name):
            failed.append(name)
    return failed


def run_named(fill: Callable[[torch.Tensor, Any, Any, Any, tuple[int, ...], int], bool]) -> list[str]:
    """Names of the named cases whose digest is not :data:`NAMED_GOLDEN` (empty: all pass).

    ``fill(out, dist, key, region, sample_shape, threads)`` is the implementation under test.
    """
    from keyinit.keys import Key
    from keyinit.regions import make_region

    key = Key(*KEY_WORDS, "v2")
    failed = []
    for name, dist, dtype, shape, region, sample_shape, layout, threads in named_cases():
        reg = make_region(shape, region)
        out = _empty(reg.region_shape, dtype, layout)
        if not fill(out, dist, key, reg, sample_shape, threads) or digest(out) != NAMED_GOLDEN.get(name):
            failed.append(name)
    return failed


def run_folded(derive: Callable[[int, int, int, int, int, int], int],
               fill: Callable[[torch.Tensor, Any, Any, Any], bool],
               fill_folded: Callable[[torch.Tensor, Any, Any, int, int], bool]) -> list[str]:
    """Names of the failing checks of the key-deriving entry points (empty: all pass).

    ``derive(k0, k1, x0, x1, x2, x3)`` (``keyinit_derive``: Philox words 0 and 1 as ``w0 | w1 << 32``)
    must give ``keyinit.fold_in``'s key words (Python Philox) for ints and strings across the word
    boundaries, and ``fill_folded(out, dist, key, fold0, fold1)`` (``keyinit_fill_folded``) the values of
    ``fill(out, dist, key, region)`` (the golden-checked entry point) under
    ``fold_in(fold_in(key, fold0), fold1)``.
    """
    from keyinit.distributions import Bernoulli, Normal, Randint, Uniform
    from keyinit.keys import Key, fold_in, fold_inputs
    from keyinit.regions import make_region

    failed = []
    key = Key(*KEY_WORDS)
    for data in (0, 1, 2**32 - 1, 2**32, 2**64 - 1, "python.random", ""):
        tag, (x0, x1, x3) = fold_inputs(data)
        got = derive(key.k0, key.k1, x0, x1, tag, x3)
        if (got & 0xFFFFFFFF, got >> 32) != fold_in(key, data).words:
            failed.append(f"derive-{data!r}")
    for name, dist, dtype, n, folds in (
            ("folded-uniform", Uniform.create(-1.0, 3.0), torch.float32, 1031, (7, 0)),
            ("folded-normal-f64", Normal.create(0.0, 1.0), torch.float64, 70, (2**40 + 3, 1)),
            ("folded-randint", Randint.create(-5, 2**31, torch.int64), torch.int64, 333, (0, 2**64 - 1)),
            ("folded-bernoulli-bool", Bernoulli.create(0.3), torch.bool, 100, (12, 2))):
        want = torch.zeros(n, dtype=dtype, device="cpu")
        got = torch.zeros(n, dtype=dtype, device="cpu")
        ok = fill(want, dist, fold_in(fold_in(key, folds[0]), folds[1]), make_region((n,), None))
        if not ok or not fill_folded(got, dist, key, folds[0], folds[1]) or digest(got) != digest(want):
            failed.append(name)
    return failed


def run_mt_seed(mt_seed: Callable[[list[int]], list[int]]) -> list[str]:
    """Names of the failing checks of ``keyinit_mt_seed`` (``mt_seed(key words) -> 624 state words``):
    its state must be CPython's ``random.seed`` of the int whose 32-bit words are the key (one word and
    two, with the high bits set, and zero)."""
    import random

    failed = []
    for seed in (0, 1, 0xFFFFFFFF, 2**32, 0x243F6A8885A308D3, 2**64 - 1):
        key = [seed & 0xFFFFFFFF] + ([seed >> 32] if seed >> 32 else [])
        if mt_seed(key) != list(random.Random(seed).getstate()[1][:624]):
            failed.append(f"mt-seed-{seed:#x}")
    return failed
