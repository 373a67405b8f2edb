"""Golden self-test of the compiled CPU permutation kernel, run once when it is loaded.

The counterpart of :mod:`keyinit._kernels.fill.selftest` for ``permutation_kernels.c``:
before :mod:`keyinit._kernels.permutation.cpu` uses a library, it runs the
cases below and compares SHA-256 digests of the outputs with :data:`GOLDEN`,
the values of the reference (:mod:`keyinit._draw.reference_permutation`);
``tests/kernels/test_kernel_libraries.py`` recomputes them from the reference.

The cases are small (about 60k positions) and cover what could differ: the
12-round (at most 16 bits) and 6-round domains on both sides of the switch,
odd and even bit counts, heavy cycle walking (``n`` just above a power of
two), the inverse, index vectors and ``start + step * k`` positions (a negative
step), domains up to ``2**62``, counts that are not a multiple of the vector
width or of the kernel's chunk, and two threads.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional

import torch

__all__ = ["GOLDEN", "KEY_WORDS", "cases", "positions", "run"]

#: Key (k0, k1) of every case (the permutation key Kp is derived from it and n).
KEY_WORDS = (0xA4093822, 0x299F31D0)

#: ``(name, n, positions: range or "indexed", inverse, threads)``.
Case = tuple[str, int, object, bool, int]


def cases() -> list[Case]:
    """``(name, n, positions, inverse, threads)`` of every case; ``positions`` a range or ``"indexed"``."""
    return [
        ("n5-whole", 5, range(5), False, 1),
        ("n7-inverse", 7, range(7), True, 1),
        ("n2**16-strided", 2**16, range(3, 2**16, 7), False, 1),
        ("n2**16+1-walking", 2**16 + 1, range(2**16 - 700, 2**16 + 1), False, 1),
        ("n10**9-indexed", 10**9, "indexed", False, 1),
        ("n-odd-bits-inverse-indexed", 3 * 2**40 + 5, "indexed", True, 1),
        ("n2**62-reversed", 2**62, range(2**62 - 1, 2**62 - 3001, -3), False, 1),
        ("n10**6-two-threads", 10**6 + 3, range(1, 10**6, 20), False, 2),
    ]


def positions(n: int, spec: object) -> tuple[Optional[torch.Tensor], range]:
    """``(index tensor or None, range)`` of a case: an ``"indexed"`` case gets 1001 scattered positions."""
    if isinstance(spec, range):
        return None, spec
    k = torch.arange(1001, dtype=torch.int64)
    return (k * 2654435761 + 12345) % n, range(0)


def digest(out: torch.Tensor) -> str:
    """SHA-256 (16 hex digits) of ``out``'s int64 values."""
    return hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest()[:16]


#: sha256(output bytes)[:16] of each case, as the reference produces them.
GOLDEN = {
    "n5-whole": "f2dd900c20cf0f0d",
    "n7-inverse": "3680cd783137fe24",
    "n2**16-strided": "744cd3b06511cbc5",
    "n2**16+1-walking": "3705b831513e3a66",
    "n10**9-indexed": "ba428b0bf05b494e",
    "n-odd-bits-inverse-indexed": "137bd801ee18d681",
    "n2**62-reversed": "e0806995dbeea40e",
    "n10**6-two-threads": "d459e97397626044",
}


def run(permute: Callable[..., bool]) -> list[str]:
    """Names of the cases whose digest is not :data:`GOLDEN` (empty: all pass).

    ``permute(kp, n, inverse, out, positions=..., start=..., step=..., threads=...)`` is the
    implementation under test (the signature of :func:`keyinit._kernels.permutation.cpu.run`).
    """
    from keyinit._draw.reference_permutation import permutation_key
    from keyinit.keys import Key

    root = Key(*KEY_WORDS)
    failed = []
    for name, n, spec, inverse, threads in cases():
        index, r = positions(n, spec)
        count = len(r) if index is None else int(index.numel())
        out = torch.full((count,), -1, dtype=torch.int64)
        kp = permutation_key(root, n).words
        ok = permute(kp, n, inverse, out, positions=index, start=r.start, step=r.step, threads=threads)
        if not ok or digest(out) != GOLDEN.get(name):
            failed.append(name)
    return failed
