"""Statistical quality of the v1 samplers (fixed keys, so every test is deterministic).

Tolerances are about 5 standard errors, or asymptotic critical values at a
small significance level: a correct sampler passes with overwhelming
probability and, the keys being fixed, then passes forever. These run in the
default test run (marked ``slow`` only so they can be deselected).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import keyinit
from keyinit import random as kr

pytestmark = pytest.mark.slow

N = 10**7
KS_CRITICAL = math.sqrt(-math.log(1e-3 / 2) / 2)  # asymptotic Kolmogorov quantile at alpha = 0.001: 1.949

_erfc = np.frompyfunc(math.erfc, 1, 1)


def normal_cdf(x: np.ndarray) -> np.ndarray:
    """Phi(x) = erfc(-x / sqrt 2) / 2 with math.erfc, elementwise (exact-enough: ~1 ulp)."""
    return 0.5 * _erfc(-x / math.sqrt(2.0)).astype(np.float64)


def ks_statistic(sorted_sample: np.ndarray, cdf_values: np.ndarray) -> float:
    """Kolmogorov-Smirnov D of a sorted sample whose model CDF at each point is ``cdf_values``."""
    n = sorted_sample.size
    i = np.arange(1, n + 1, dtype=np.float64)
    return float(max(np.max(i / n - cdf_values), np.max(cdf_values - (i - 1) / n)))


@pytest.fixture(scope="module")
def normals() -> np.ndarray:
    return kr.normal(keyinit.key_for(0, "stats.normal"), (N,)).double().numpy()


@pytest.fixture(scope="module")
def uniforms() -> np.ndarray:
    return kr.uniform(keyinit.key_for(0, "stats.uniform"), (N // 4,)).double().numpy()


# ---------------------------------------------------------------- normal


def test_normal_moments(normals):
    n = normals.size
    mean = normals.mean()
    centered = normals - mean
    var = np.mean(centered**2)
    skew = np.mean(centered**3) / var**1.5
    excess_kurtosis = np.mean(centered**4) / var**2 - 3.0
    assert abs(mean) < 5 / math.sqrt(n)
    assert abs(var - 1.0) < 5 * math.sqrt(2 / n)
    assert abs(skew) < 5 * math.sqrt(6 / n)
    assert abs(excess_kurtosis) < 5 * math.sqrt(24 / n)


def test_normal_ks_against_exact_cdf(normals):
    ordered = np.sort(normals)
    d = ks_statistic(ordered, normal_cdf(ordered))
    assert d * math.sqrt(ordered.size) < KS_CRITICAL, d


def test_normal_tails(normals):
    n = normals.size
    assert np.abs(normals).max() >= 5.0
    assert np.abs(normals).max() <= 6.337958335876465  # the largest magnitude v1 can produce
    for threshold in (2.0, 3.0, 4.0):
        p = math.erfc(threshold / math.sqrt(2))  # P(|z| > threshold)
        frequency = np.mean(np.abs(normals) > threshold)
        assert abs(frequency - p) < 5 * math.sqrt(p * (1 - p) / n), threshold
    # both signs equally often in the far tail
    assert abs(np.sum(normals > 3) - np.sum(normals < -3)) < 5 * math.sqrt(np.sum(np.abs(normals) > 3))


def test_normal_lag_one_autocorrelation(normals):
    x = normals - normals.mean()
    r = np.dot(x[:-1], x[1:]) / np.dot(x, x)
    assert abs(r) < 5 / math.sqrt(x.size)


# ---------------------------------------------------------------- uniform


def test_uniform_moments_and_range(uniforms):
    n = uniforms.size
    assert uniforms.min() >= 0.0 and uniforms.max() < 1.0
    assert abs(uniforms.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(uniforms.var() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)  # Var of (U - 1/2)^2 is 1/180


def test_uniform_ks(uniforms):
    ordered = np.sort(uniforms)
    d = ks_statistic(ordered, ordered)
    assert d * math.sqrt(ordered.size) < KS_CRITICAL, d


# ---------------------------------------------------------------- truncated normal


FAR_AND_ODD_CASES = [
    # (mean, std, a, b)
    (0.0, 1.0, 5.0, 6.0),
    (0.0, 1.0, -6.0, -5.0),
    (0.0, 1.0, -30.0, -29.0),
    (0.0, 1.0, 29.0, 30.0),
    (0.0, 1.0, 8.0, 1e6),
    (0.0, 1.0, -1e30, -12.0),
    (0.0, 1.0, 0.1, 0.1 + 1e-6),
    (3.0, 1e-8, -1.0, 1.0),
    (0.0, 0.0, -1.0, 1.0),
    (5.0, 0.0, -1.0, 1.0),
    (-5.0, 0.0, -1.0, 1.0),
    (0.0, 1e30, -1.0, 1.0),
    (0.0, 0.02, -0.04, 0.04),
    (0.0, 1.0, -1e-30, 1e-30),
]


@pytest.mark.parametrize("mean, std, a, b", FAR_AND_ODD_CASES)
def test_truncated_normal_within_bounds_far_tails_and_degenerate(mean, std, a, b):
    k = keyinit.key_for(0, "stats.truncated")
    for dtype in (torch.float32, torch.bfloat16):
        try:
            values = kr.truncated_normal(k, (20_000,), mean=mean, std=std, a=a, b=b, dtype=dtype).double()
        except ValueError as error:
            assert dtype == torch.bfloat16 and "lies in [a, b]" in str(error)  # too narrow for bfloat16
            continue
        assert torch.isfinite(values).all()
        assert float(values.min()) >= a and float(values.max()) <= b, (dtype, float(values.min()), float(values.max()))


def test_truncated_normal_within_bounds_random_parameters():
    rng = np.random.default_rng(20240601)
    k = keyinit.key_for(0, "stats.truncated.random")
    empty = 0
    for trial in range(300):
        mean = rng.normal(0, 10)
        std = 0.0 if trial % 10 == 0 else 10 ** rng.uniform(-6, 3)
        a = mean + rng.normal(0, 3) * (std if std else 1.0) * rng.choice([1, 10])
        b = a + 10 ** rng.uniform(-7, 2)
        try:
            values = kr.truncated_normal(keyinit.fold_in(k, trial), (2000,), mean=mean, std=std, a=a, b=b).double()
        except ValueError as error:  # [a, b] holds no float32 value
            assert "lies in [a, b]" in str(error)
            empty += 1
            continue
        assert float(values.min()) >= a and float(values.max()) <= b, (mean, std, a, b)
    assert empty < 30


def test_truncated_normal_far_tail_mean():
    # N(0, 1) on [5, 6]: the flip puts the interval below the median, where binary32 resolves it
    values = kr.truncated_normal(keyinit.key_for(0, "stats.far"), (200_000,), a=5.0, b=6.0).double().numpy()
    phi = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    mass = 0.5 * (math.erfc(5 / math.sqrt(2)) - math.erfc(6 / math.sqrt(2)))
    mean = (phi(5) - phi(6)) / mass
    second = 1 + (5 * phi(5) - 6 * phi(6)) / mass
    sd = math.sqrt(second - mean**2)
    assert abs(values.mean() - mean) < 5 * sd / math.sqrt(values.size)
    assert values.min() > 5.0 and values.max() < 6.0


@pytest.mark.parametrize("mean, std, a, b", [(0.3, 1.5, -1.0, 2.0), (0.0, 1.0, 0.5, 4.0)])  # plain, and flipped
def test_truncated_normal_ks(mean, std, a, b):
    values = kr.truncated_normal(keyinit.key_for(0, "stats.tn_ks"), (500_000,), mean=mean, std=std, a=a, b=b)
    ordered = np.sort(values.double().numpy())
    low, high = normal_cdf(np.array([(a - mean) / std, (b - mean) / std]))
    cdf = (normal_cdf((ordered - mean) / std) - low) / (high - low)
    d = ks_statistic(ordered, cdf)
    assert d * math.sqrt(ordered.size) < KS_CRITICAL, d


# ---------------------------------------------------------------- bernoulli, randint


@pytest.mark.parametrize("p", [0.5, 0.3, 1e-3, 0.999])
def test_bernoulli_frequency(p):
    n = 10**6
    values = kr.bernoulli(keyinit.key_for(0, f"stats.bernoulli.{p}"), (n,), p=p)
    frequency = float(values.double().mean())
    exact = round(p * 2**32) / 2**32
    assert abs(frequency - exact) < 5 * math.sqrt(exact * (1 - exact) / n)


def _chi_square_critical(dof: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.719 is alpha = 1e-4."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("low, high", [(0, 2), (-3, 4), (10, 20), (0, 100)])
def test_randint_uniform_chi_square(low, high):
    n = 500_000
    values = kr.randint(keyinit.key_for(0, f"stats.randint.{low}.{high}"), (n,), low=low, high=high)
    assert int(values.min()) == low and int(values.max()) == high - 1
    counts = torch.bincount(values - low, minlength=high - low).double().numpy()
    expected = n / (high - low)
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < _chi_square_critical(high - low - 1), chi2


def test_randint_full_32_bit_range_top_bits_uniform():
    n = 500_000
    values = kr.randint(keyinit.key_for(0, "stats.randint.full"), (n,), low=0, high=2**32)
    assert int(values.min()) >= 0 and int(values.max()) < 2**32
    counts = torch.bincount(values >> 28, minlength=16).double().numpy()
    chi2 = float(np.sum((counts - n / 16) ** 2 / (n / 16)))
    assert chi2 < _chi_square_critical(15), chi2


# ---------------------------------------------------------------- independence of derived keys


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / torch.sqrt((x * x).sum() * (y * y).sum()))


def test_sibling_keys_uncorrelated():
    n = 10**6
    parent = keyinit.key_for(0, "stats.siblings")
    left, right = keyinit.split(parent)
    pairs = {
        "split": (left, right),
        "fold_in int": (keyinit.fold_in(parent, 0), keyinit.fold_in(parent, 1)),
        "fold_in str": (keyinit.fold_in(parent, "wq"), keyinit.fold_in(parent, "wk")),
        "parent/child": (parent, left),
        "fold_in int/str": (keyinit.fold_in(parent, 1), keyinit.fold_in(parent, "1")),
    }
    draws: dict = {}
    for name, (a, b) in pairs.items():
        x = draws.setdefault(a, kr.normal(a, (n,)))
        y = draws.setdefault(b, kr.normal(b, (n,)))
        assert abs(_pearson(x, y)) < 5 / math.sqrt(n), name
