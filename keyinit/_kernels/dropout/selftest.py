"""Golden self-test of the compiled CPU dropout kernel, run once when it is loaded.

The counterpart of :mod:`keyinit._kernels.fill.selftest` for ``dropout_kernels.c``:
before :mod:`keyinit._kernels.dropout.cpu` uses a library, it runs the cases
below and compares SHA-256 digests of the output bytes with :data:`GOLDEN`, the
bytes the reference (:func:`keyinit._draw.reference_dropout.dropout`) produces;
``tests/kernels/test_hostile_kernels.py`` recomputes them from the reference.

The cases are small (about 150k elements) and cover what could differ: each
dtype's scaling and rounding (fp16 overflow to infinity, subnormal products),
runs that start off a Philox block boundary, merged and split dimensions, index
vectors, flat indices near 2**62, ``p`` at 0 and near 1, and two threads.

:data:`NAMED_GOLDEN` does the same for a keyed forward's activations under stream v2's names
(``docs/spec.md`` 14.8: high counter words, short rows packed into whole vector passes, the outer
indices advanced with the carries), as :func:`keyinit._draw.reference_dropout.dropout` gives them.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import torch

__all__ = ["GOLDEN", "KEY_WORDS", "NAMED_GOLDEN", "cases", "named_cases", "named_geometry", "inputs", "run"]

#: Key (k0, k1) of every case.
KEY_WORDS = (0x13198A2E, 0x03707344)

_BIG = 2**31


def cases() -> list[tuple[str, torch.dtype, tuple[int, ...], Optional[tuple], float, int, str]]:
    """``(name, dtype, global shape, region, p, threads, values)`` of every case."""
    return [
        ("f32-whole", torch.float32, (3, 37, 11), None, 0.3, 1, "mixed"),
        ("f64-rows", torch.float64, (9, 37, 11), (slice(5, 8), slice(None), slice(None)), 0.1, 1, "mixed"),
        ("bf16-index", torch.bfloat16, (9, 40, 11), ([0, 8, 3], list(range(39, 2, -1)), slice(None)), 0.5, 1,
         "mixed"),
        ("f16-overflow", torch.float16, (3, 37, 15), (slice(None), slice(None), [14, 0, 3, 3, 7, 1, 9]), 0.3, 1,
         "huge"),
        ("f32-subnormal", torch.float32, (4, 300), (slice(None), slice(3, 290)), 0.25, 1, "tiny"),
        ("f32-near-2**62", torch.float32, (_BIG, _BIG), (slice(_BIG - 3, None), slice(_BIG - 407, None)), 0.3, 1,
         "mixed"),
        ("f64-p0", torch.float64, (1000,), None, 0.0, 1, "mixed"),
        ("f32-p-near-1", torch.float32, (1000,), None, 1 - 1e-9, 1, "mixed"),
        ("f32-two-threads", torch.float32, (20001,), None, 0.2, 2, "mixed"),
    ]


def named_cases() -> list[tuple[str, torch.dtype, tuple[int, ...], int, float, int, str]]:
    """``(name, dtype, activation shape, first sample, p, threads, values)`` of every case under stream v2's
    names (row ``r`` of the activation is sample ``first + r``)."""
    return [
        ("v2-f32-short-rows", torch.float32, (3, 7, 40), 5, 0.3, 1, "mixed"),
        ("v2-bf16-3-coords", torch.bfloat16, (2, 3, 5, 128), 2**31 - 2, 0.1, 1, "mixed"),
        ("v2-f32-rows-across-chunks", torch.float32, (3, 41, 331), 0, 0.2, 2, "mixed"),
    ]


def named_geometry(shape: tuple[int, ...], first: int, p: float):
    """The geometry of a named case (the one a keyed forward under stream v2 gives such an activation)."""
    from keyinit._draw.dropout_geometry import rows_template, with_key

    return with_key(rows_template(shape, first, p, "v2"), *KEY_WORDS)


def inputs(shape: tuple[int, ...], dtype: torch.dtype, values: str) -> torch.Tensor:
    """Deterministic inputs (no RNG): signed values, fp16-overflowing ones, or subnormal float32 ones."""
    n = 1
    for size in shape:
        n *= size
    k = torch.arange(n, dtype=torch.float64)
    if values == "huge":
        x = 40000.0 + (k % 7) * 4000.0
    elif values == "tiny":
        x = (k % 13 - 6) * 1e-40
    else:
        x = (k * 0.37) % 7 - 3.5
    return x.to(dtype).reshape(shape)


def digest(out: torch.Tensor) -> str:
    """SHA-256 (16 hex digits) of ``out``'s values as row-major bytes."""
    dense = out.contiguous().reshape(-1)
    return hashlib.sha256(dense.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


#: sha256(output bytes)[:16] of each case, as the reference produces them.
GOLDEN = {
    "f32-whole": "7666d8fe9fbfcb3d",
    "f64-rows": "3ad622b4ffbf8049",
    "bf16-index": "25b6467a2628e0cc",
    "f16-overflow": "66be3d7de1f94d89",
    "f32-subnormal": "3c94a3f70fccd2e4",
    "f32-near-2**62": "5a5ee57adeb2fd21",
    "f64-p0": "3ffff53aa03ce267",
    "f32-p-near-1": "fc19b19971194257",
    "f32-two-threads": "939a617728ea225b",
}


#: sha256(output bytes)[:16] of each named case, as the reference produces them.
NAMED_GOLDEN = {
    "v2-f32-short-rows": "71a4ea55ac95b322",
    "v2-bf16-3-coords": "01e74f19471649df",
    "v2-f32-rows-across-chunks": "bcfd9c85a23fda49",
}


def run(dropout: Callable[[torch.Tensor, torch.Tensor, Any, int], bool]) -> list[str]:
    """Names of the cases whose digest is not :data:`GOLDEN` (empty: all pass).

    ``dropout(x, out, geometry, threads)`` is the implementation under test.
    """
    from keyinit._draw.dropout_geometry import layout_for, make_geometry
    from keyinit.regions import make_region

    failed = []
    for name, dtype, shape, region, p, threads, values in cases():
        local = make_region(shape, region).region_shape
        x = inputs(local, dtype, values)
        layout = layout_for(local, shape, region)
        geometry = make_geometry(local, *KEY_WORDS, p, layout.gstrides, layout.starts, layout.indices)
        out = torch.full_like(x, 7.0)
        if not dropout(x, out, geometry, threads) or digest(out) != GOLDEN.get(name):
            failed.append(name)
    for name, dtype, shape, first, p, threads, values in named_cases():
        x = inputs(shape, dtype, values)
        out = torch.full_like(x, 7.0)
        if not dropout(x, out, named_geometry(shape, first, p), threads) or digest(out) != NAMED_GOLDEN.get(name):
            failed.append(name)
    return failed
