"""Distributions of stream v1: parameters and the map from stream words to values.

Each distribution is an immutable value holding its parameters already
prepared for the device (binary32 constants, integer thresholds), plus
``words_per_element`` (``w``): element ``i`` of a tensor consumes stream words
``w*i .. w*i + w - 1`` (see :func:`keyinit._bits.philox.stream_words`).

``transform`` is the reference definition of each distribution: it maps the
words of a batch of elements (int64 tensors holding uint32 values) to values.
Float distributions are always computed in binary32 (see ``keyinit._bits.fp32math``) and
then converted to the requested dtype with round-to-nearest-even, so a
bfloat16 or float16 draw is the float32 draw rounded, and a float64 draw is
the float32 draw widened exactly. Fast kernels must reproduce these bits.
"""

from __future__ import annotations

import math
from typing import ClassVar

import attrs
import torch

from keyinit._bits.fp32math import f32, ndtri_f32, ndtri_tail_f32
from keyinit._bits.hostmath import normal_cdf64

__all__ = [
    "Distribution",
    "Bits",
    "Uniform",
    "Normal",
    "TruncatedNormal",
    "Bernoulli",
    "Randint",
    "FLOAT_DTYPES",
    "INT_DTYPES",
]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

_TWO_POW_M24 = 2.0**-24
_TWO_POW_M33 = 2.0**-33


class Distribution:
    """Base of the v1 distributions (a marker with the shared interface)."""

    name: ClassVar[str]
    words_per_element: ClassVar[int]
    #: dtypes the distribution can produce; the first is its default.
    dtypes: ClassVar[tuple[torch.dtype, ...]]

    def transform(self, words: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def check_dtype(self, dtype: torch.dtype) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        if dtype not in self.dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
            raise TypeError(f"{self.name} cannot produce dtype {dtype}; supported: {allowed}")


def _finite(value: object, name: str, dist: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{dist}: {name} must be a real number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{dist}: {name} must be finite, got an int too large for a float") from None
    if not math.isfinite(value):
        raise ValueError(f"{dist}: {name} must be finite, got {value}")
    return value


def _f32_finite(value: float, name: str, dist: str) -> float:
    try:
        rounded = f32(value)
    except OverflowError:  # struct refuses finite values that round to infinity
        rounded = math.inf
    if not math.isfinite(rounded):
        raise ValueError(f"{dist}: {name}={value} overflows float32")
    return rounded


def _unit_open_below(x: torch.Tensor) -> torch.Tensor:
    """``u = (x >> 8) * 2**-24`` in ``[0, 1)``, exact in float32."""
    return (x >> 8).to(torch.float32) * _TWO_POW_M24


@attrs.frozen
class Bits(Distribution):
    """Raw stream words: element ``i`` is word ``i`` as an int64 in ``[0, 2**32)``."""

    name: ClassVar[str] = "bits"
    words_per_element: ClassVar[int] = 1
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.int64,)

    def transform(self, words: list[torch.Tensor]) -> torch.Tensor:
        return words[0]


@attrs.frozen
class Uniform(Distribution):
    """``low + span * u`` with ``u = (x >> 8) * 2**-24``, in binary32.

    ``low = f32(low)``, ``span = f32(high - low)`` (difference taken in binary64).
    Values lie in ``[low, high]``: ``high`` itself is reachable only by rounding.
    """

    name: ClassVar[str] = "uniform"
    words_per_element: ClassVar[int] = 1
    dtypes: ClassVar[tuple[torch.dtype, ...]] = FLOAT_DTYPES
    low: float
    span: float

    @classmethod
    def create(cls, low: float, high: float) -> "Uniform":
        low = _finite(low, "low", cls.name)
        high = _finite(high, "high", cls.name)
        if not low < high:
            raise ValueError(f"uniform: expected low < high, got low={low}, high={high}")
        return cls(_f32_finite(low, "low", cls.name), _f32_finite(high - low, "high - low", cls.name))

    def transform(self, words: list[torch.Tensor]) -> torch.Tensor:
        return self.low + self.span * _unit_open_below(words[0])


@attrs.frozen
class Normal(Distribution):
    """``mean + std * z`` with ``z`` from the inverse normal CDF, in binary32.

    Bit 0 of the word is the sign (1 means negative); the tail probability is
    ``t = f32(x | 1) * 2**-33`` in ``(0, 0.5]`` and ``|z| = ndtri_tail(t)``,
    so ``|z|`` reaches about 6.3.
    """

    name: ClassVar[str] = "normal"
    words_per_element: ClassVar[int] = 1
    dtypes: ClassVar[tuple[torch.dtype, ...]] = FLOAT_DTYPES
    mean: float
    std: float

    @classmethod
    def create(cls, mean: float, std: float) -> "Normal":
        mean = _finite(mean, "mean", cls.name)
        std = _finite(std, "std", cls.name)
        if std < 0:
            raise ValueError(f"normal: expected std >= 0, got std={std}")
        return cls(_f32_finite(mean, "mean", cls.name), _f32_finite(std, "std", cls.name))

    def transform(self, words: list[torch.Tensor]) -> torch.Tensor:
        x = words[0]
        tail = (x | 1).to(torch.float32) * _TWO_POW_M33
        magnitude = ndtri_tail_f32(tail)
        z = torch.where((x & 1).bool(), -magnitude, magnitude)
        return self.mean + self.std * z


def _inward_bound(value: float, dtype: torch.dtype, upward: bool) -> float:
    """The nearest value representable in ``dtype`` (and binary32) on the inner side of ``value``."""
    target = torch.float32 if dtype == torch.float64 else dtype
    exact = torch.tensor(value, dtype=torch.float64, device="cpu")  # never the default device (meta)
    rounded = exact.to(target)
    if upward and rounded.double() < exact:
        rounded = torch.nextafter(rounded, torch.tensor(math.inf, dtype=target, device="cpu"))
    if not upward and rounded.double() > exact:
        rounded = torch.nextafter(rounded, torch.tensor(-math.inf, dtype=target, device="cpu"))
    return float(rounded)


@attrs.frozen
class TruncatedNormal(Distribution):
    """The normal ``N(mean, std**2)`` restricted to ``[a, b]`` (absolute bounds), by inversion.

    On the host, in binary64 with :func:`keyinit._bits.hostmath.normal_cdf64`:
    ``alpha = (a - mean) / std``, ``beta = (b - mean) / std``; if
    ``alpha + beta > 0`` the interval is mirrored (``flip``) so its longer
    tail lies below the median, where binary32 resolves small probabilities;
    ``p_low = Phi(alpha)``, ``p_span = Phi(beta) - Phi(alpha)``, both then rounded to
    binary32. On the device, in binary32::

        u = f32(2 * (x >> 9) + 1) * 2**-24          # in (0, 1)
        z = ndtri(p_low + u * p_span) ; z = -z if flip
        value = min(max(mean + std * z, lower), upper)

    ``lower``/``upper`` are ``a``/``b`` rounded inward to the output dtype, so
    every value of every dtype lies in ``[a, b]``. No rejection loop: one word
    per element, whatever the bounds.
    """

    name: ClassVar[str] = "truncated_normal"
    words_per_element: ClassVar[int] = 1
    dtypes: ClassVar[tuple[torch.dtype, ...]] = FLOAT_DTYPES
    mean: float
    std: float
    p_low: float
    p_span: float
    flip: bool
    lower: float
    upper: float

    @classmethod
    def create(cls, mean: float, std: float, a: float, b: float, dtype: torch.dtype) -> "TruncatedNormal":
        mean = _finite(mean, "mean", cls.name)
        std = _finite(std, "std", cls.name)
        a = _finite(a, "a", cls.name)
        b = _finite(b, "b", cls.name)
        if std < 0:
            raise ValueError(f"truncated_normal: expected std >= 0, got std={std}")
        if not a < b:
            raise ValueError(f"truncated_normal: expected a < b, got a={a}, b={b}")
        if std > 0:
            alpha, beta = (a - mean) / std, (b - mean) / std
        else:
            alpha, beta = -1.0, 1.0  # z is multiplied by 0; any valid interval will do
        flip = alpha + beta > 0
        if flip:
            alpha, beta = -beta, -alpha
        p_low = normal_cdf64(alpha)
        p_span = normal_cdf64(beta) - p_low
        Distribution.check_dtype(cls, dtype)  # type: ignore[arg-type]  # the bounds need a float dtype
        lower, upper = _inward_bound(a, dtype, True), _inward_bound(b, dtype, False)
        if not lower <= upper:
            raise ValueError(f"truncated_normal: no {dtype} value lies in [a, b] = [{a}, {b}]")
        return cls(
            _f32_finite(mean, "mean", cls.name),
            _f32_finite(std, "std", cls.name),
            f32(p_low),
            f32(p_span),
            flip,
            lower,
            upper,
        )

    def transform(self, words: list[torch.Tensor]) -> torch.Tensor:
        u = (((words[0] >> 9) << 1) | 1).to(torch.float32) * _TWO_POW_M24
        z = ndtri_f32(self.p_low + u * self.p_span)
        if self.flip:
            z = -z
        return torch.clamp(self.mean + self.std * z, min=self.lower, max=self.upper)


@attrs.frozen
class Bernoulli(Distribution):
    """``x < threshold`` with ``threshold = round_half_even(p * 2**32)``: exactly ``P = threshold / 2**32``."""

    name: ClassVar[str] = "bernoulli"
    words_per_element: ClassVar[int] = 1
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.bool, *FLOAT_DTYPES, *INT_DTYPES)
    threshold: int

    @classmethod
    def create(cls, p: float) -> "Bernoulli":
        p = _finite(p, "p", cls.name)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"bernoulli: expected p in [0, 1], got p={p}")
        return cls(round(p * 2.0**32))

    def transform(self, words: list[torch.Tensor]) -> torch.Tensor:
        return words[0] < self.threshold


_MASK16 = 0xFFFF


def _mulhi_u32_by_small(x: torch.Tensor, n_hi: int, n_lo: int, carry: torch.Tensor) -> torch.Tensor:
    """``floor((x * n + carry) / 2**32)`` for ``x, carry < 2**32`` and ``n = n_hi * 2**16 + n_lo <= 2**32``."""
    return (x * n_hi + ((x * n_lo + carry) >> 16)) >> 16


@attrs.frozen
class Randint(Distribution):
    """``low + floor(v * n / 2**64)`` with ``v = w0 + w1 * 2**32`` and ``n = high - low <= 2**32``.

    Two words per element; the bias of any outcome is below ``n / 2**64``.
    """

    name: ClassVar[str] = "randint"
    words_per_element: ClassVar[int] = 2
    dtypes: ClassVar[tuple[torch.dtype, ...]] = INT_DTYPES
    low: int
    span: int

    @classmethod
    def create(cls, low: int, high: int, dtype: torch.dtype) -> "Randint":
        for name, value in (("low", low), ("high", high)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"randint: {name} must be an int, got {type(value).__name__}")
        if not low < high:
            raise ValueError(f"randint: expected low < high, got low={low}, high={high}")
        if high - low > 2**32:
            raise ValueError(f"randint: high - low must be at most 2**32, got {high - low}")
        if dtype in INT_DTYPES:
            info = torch.iinfo(dtype)
            if low < info.min or high - 1 > info.max:
                raise ValueError(
                    f"randint: [{low}, {high}) does not fit {dtype} (range [{info.min}, {info.max}])"
                )
        return cls(low, high - low)

    def transform(self, words: list[torch.Tensor]) -> torch.Tensor:
        n_hi, n_lo = self.span >> 16, self.span & _MASK16
        w0, w1 = words
        carry = _mulhi_u32_by_small(w0, n_hi, n_lo, torch.zeros_like(w0))
        return self.low + _mulhi_u32_by_small(w1, n_hi, n_lo, carry)
