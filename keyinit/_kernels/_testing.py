"""Test support for the kernels: the reference with a correctly rounded ``sqrt``.

Stream v1 specifies ``sqrt`` as the IEEE-754 (correctly rounded) binary32
square root (``_fp32math``: "Every function here is a fixed sequence of
IEEE-754 binary32 operations that are correctly rounded everywhere"). On x86
builds of torch that use MKL's vector math, ``torch.sqrt`` on float32 is not
correctly rounded: about 0.6% of the inputs in ``[0.5, 128)`` (the range
``ndtri`` feeds it) come back one ulp off, so the reference's normal and
truncated-normal values then differ from the spec (and from the reference on
CUDA or on builds without MKL) in about 0.1% of the elements.

:func:`reference_fill` runs :func:`keyinit._reference.fill` unchanged, except
that when this build's ``torch.sqrt`` is not correctly rounded, ``torch.sqrt`` is
replaced for the duration of the call by ``sqrt(x in binary64)`` rounded to
binary32, which is the correctly rounded binary32 square root (the exact root of
a binary32 value is never within 2**-50 relative of a binary32 rounding midpoint,
far beyond the error of a binary64 ``sqrt``). Where ``torch.sqrt`` is already
correct this is exactly the reference.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch

from keyinit import _reference
from keyinit.distributions import Distribution
from keyinit.keys import Key
from keyinit.regions import Region

__all__ = ["torch_sqrt_is_correctly_rounded", "ieee_sqrt", "reference_fill", "SQRT_PROBES"]

#: float32 inputs whose correctly rounded square root MKL's vsSqrt misses by one ulp
#: (found by an exhaustive sweep of [0.5, 128) on an AVX-512 machine), plus a few exact squares.
SQRT_PROBES = (0.5000009536743164, 0.5000019669532776, 2.836967706680298, 2.963594198226929,
               2.779351234436035, 4.0, 2.25, 100.0)

_lock = threading.Lock()


def _sqrt_rn(original, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32 and not args and not kwargs:
        return original(x.double()).to(torch.float32)
    return original(x, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def torch_sqrt_is_correctly_rounded() -> bool:
    """Whether ``torch.sqrt`` on CPU float32 agrees with the correctly rounded root on a sweep of inputs."""
    import numpy as np

    start = np.float32(0.5).view(np.uint32)
    bits = np.arange(int(start), int(start) + (1 << 20), dtype=np.uint32)
    values = np.concatenate([bits.view(np.float32), np.array(SQRT_PROBES, dtype=np.float32)])
    got = torch.sqrt(torch.from_numpy(values)).numpy()
    return bool(np.array_equal(got.view(np.uint32), np.sqrt(values).view(np.uint32)))


@contextlib.contextmanager
def ieee_sqrt() -> Iterator[None]:
    """Make ``torch.sqrt`` correctly rounded on float32 for the duration (no-op where it already is)."""
    if torch_sqrt_is_correctly_rounded():
        yield
        return
    with _lock:
        original = torch.sqrt
        torch.sqrt = functools.partial(_sqrt_rn, original)  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.sqrt = original  # type: ignore[assignment]


def reference_fill(out: torch.Tensor, dist: Distribution, key: Key, region: Region) -> None:
    """:func:`keyinit._reference.fill` with the spec's correctly rounded ``sqrt``."""
    with ieee_sqrt():
        _reference.fill(out, dist, key, region)
