"""Deterministic binary64 helpers evaluated once per call, on the host.

Python floats are IEEE-754 binary64 with correctly rounded ``+ - * /`` and
``math.sqrt``/``math.ldexp`` on every platform CPython supports. ``math.exp``
and ``math.erfc`` come from the platform libm and may differ in the last ulp,
so the normal CDF is built here from basic operations only, in a fixed order.
"""

from __future__ import annotations

import math

__all__ = ["exp64", "normal_cdf64"]

_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_INV_SQRT_PI = 0.56418958354775628695
_INV_SQRT2 = 0.70710678118654752440


def exp64(x: float) -> float:
    """``e**x`` from range reduction ``x = n*ln2 + r`` and a 22-term Taylor sum."""
    if x < -745.0:
        return 0.0
    n = math.floor(x * _INV_LN2 + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    term = 1.0
    total = 1.0
    for k in range(1, 23):
        term = term * r / k
        total = total + term
    return math.ldexp(total, n)


def _erfc_positive(y: float) -> float:
    """``erfc(y)`` for ``y >= 0``."""
    if y < 2.5:
        # erf(y) = 2/sqrt(pi) * exp(-y^2) * sum_n 2^n y^(2n+1) / (1*3*...*(2n+1)); all terms positive.
        term = y
        total = y
        y2 = y * y
        for n in range(1, 120):
            term = term * 2.0 * y2 / (2 * n + 1)
            total = total + term
        return 1.0 - 2.0 * _INV_SQRT_PI * exp64(-y2) * total
    # Continued fraction erfc(y) = exp(-y^2)/sqrt(pi) * 1/(y + (1/2)/(y + 1/(y + (3/2)/(y + ...)))).
    fraction = y
    for k in range(80, 0, -1):
        fraction = y + (k * 0.5) / fraction
    return exp64(-y * y) * _INV_SQRT_PI / fraction


def normal_cdf64(x: float) -> float:
    """The standard normal CDF ``Phi(x) = erfc(-x / sqrt 2) / 2`` in binary64."""
    if math.isinf(x):
        return 0.0 if x < 0 else 1.0
    y = x * _INV_SQRT2
    if y <= 0.0:
        return 0.5 * _erfc_positive(-y)
    return 1.0 - 0.5 * _erfc_positive(y)
