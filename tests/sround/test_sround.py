"""keyinit.random.stochastic_round: shards and regions round as the whole tensor, the rounding is unbiased
with the variance p(1-p)q^2, edge cases (docs/spec.md section 17), errors, no global RNG."""

from __future__ import annotations

import math

import pytest
import torch

import keyinit
from keyinit.random import stochastic_round

TARGETS = (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn)
K = keyinit.key(2024)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.uint8)


def _data(shape, seed=3, scale=1.0):
    return keyinit.random.normal(keyinit.key(seed), shape) * scale


@pytest.mark.parametrize("dtype", TARGETS)
def test_hand_cut_shards_and_regions_round_as_the_whole_tensor(dtype):
    x = _data((37, 29), scale=3.0)
    whole = stochastic_round(K, x, dtype)
    # row shards (uneven), column shards, a strided region, an index list
    rows = [stochastic_round(K, x[a:b], dtype, global_shape=x.shape, region=(slice(a, b), slice(None)))
            for a, b in ((0, 10), (10, 11), (11, 37))]
    assert torch.equal(_bits(torch.cat(rows)), _bits(whole))
    cols = [stochastic_round(K, x[:, a:b], dtype, global_shape=x.shape, region=(slice(None), slice(a, b)))
            for a, b in ((0, 15), (15, 29))]
    assert torch.equal(_bits(torch.cat(cols, 1)), _bits(whole))
    part = stochastic_round(K, x[5:30:3, [28, 0, 7]], dtype, global_shape=(37, 29),
                            region=(slice(5, 30, 3), [28, 0, 7]))
    assert torch.equal(_bits(part), _bits(whole[5:30:3][:, [28, 0, 7]]))
    # float64 input of the same values: the same bits (the value, not its format, is rounded)
    assert torch.equal(_bits(stochastic_round(K, x.double(), dtype)), _bits(whole))


def test_out_form_and_strided_out():
    x = _data((8, 6))
    whole = stochastic_round(K, x, torch.bfloat16)
    out = torch.empty(6, 8, dtype=torch.bfloat16).t()  # non-contiguous
    assert stochastic_round(K, x, torch.bfloat16, out=out) is out
    assert torch.equal(_bits(out), _bits(whole))
    param = torch.nn.Parameter(torch.zeros(8, 6, dtype=torch.bfloat16))
    with torch.no_grad():
        stochastic_round(K, x, torch.bfloat16, out=param)
    assert torch.equal(_bits(param.detach()), _bits(whole))


def test_the_words_are_the_element_streams():
    """Element i uses word(K, i): the same words as keyinit.random.bits (and uniform, bernoulli)."""
    x = torch.full((3, 5), 1.0 + 2.0 ** -8)  # bf16: R = 2**31, up iff word >= 2**31
    words = keyinit.random.bits(K, (3, 5))
    expected = torch.where(words >= 2**31, 1.0078125, 1.0)
    assert torch.equal(stochastic_round(K, x, torch.bfloat16).float(), expected)
    assert not torch.equal(stochastic_round(keyinit.key(1), x, torch.bfloat16), stochastic_round(K, x, torch.bfloat16))


# ---------------------------------------------------------------------------------------------- statistics

#: (dtype, values): values between two neighbours at several fractions p, both signs, subnormal targets.
STAT_CASES = [
    (torch.bfloat16, [1 + 0.5 * 2**-7, 1 + 0.1 * 2**-7, -(3 + 0.9 * 2**-6), 1e-3, -7.7e-39]),
    (torch.float16, [1 + 0.5 * 2**-10, 1 + 0.03 * 2**-10, -(100.3), 3.3e-7, -2.0e-8, 60000.3]),
    (torch.float8_e5m2, [1.1, -0.3]),
    (torch.float8_e4m3fn, [1.1, -0.3, 0.005]),
]


@pytest.mark.parametrize("dtype,values", STAT_CASES, ids=[str(c[0]) for c in STAT_CASES])
def test_unbiased_with_the_bernoulli_variance(dtype, values):
    """Over many keys and elements, mean(SR(v)) = v within 5 standard errors, and the sample variance is
    p(1-p)q^2 within 5 of its standard errors (p = the fractional distance, q = the step)."""
    n_per_key, n_keys = 1 << 14, 8
    for v in values:
        x32 = torch.tensor(v, dtype=torch.float32)
        exact = float(x32)
        samples = torch.cat([
            stochastic_round(keyinit.fold_in(K, j), x32.expand(n_per_key).contiguous(), dtype).double()
            for j in range(n_keys)])
        distinct = torch.unique(samples)
        assert 1 <= distinct.numel() <= 2, (v, distinct)
        if distinct.numel() == 1:
            pytest.fail(f"{v} never rounded both ways in {samples.numel()} draws")
        lo, hi = sorted(float(d) for d in distinct)
        if abs(exact) >= abs(hi):
            lo, hi = hi, lo  # negative values: lo is the nearer to zero
        assert min(abs(lo), abs(hi)) <= abs(exact) <= max(abs(lo), abs(hi))
        q = hi - lo
        p = (exact - lo) / q
        n = samples.numel()
        se_mean = abs(q) * math.sqrt(p * (1 - p) / n)
        assert abs(float(samples.mean()) - exact) < 5 * se_mean, (v, float(samples.mean()), exact, se_mean)
        var = float(samples.var(unbiased=False))
        expected = p * (1 - p) * q * q
        # the sample variance is q^2 p'(1 - p') for the observed fraction p' = p + d, |d| < 5 sigma:
        # off by q^2 |(1 - 2p) d - d^2| at most
        d = 5 * math.sqrt(p * (1 - p) / n)
        assert abs(var - expected) <= q * q * (abs(1 - 2 * p) * d + d * d), (v, var, expected)


# ---------------------------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("dtype", TARGETS)
def test_representable_values_never_change(dtype):
    every = torch.arange(0, 1 << (8 * torch.empty((), dtype=dtype).element_size()), dtype=torch.int64)
    if dtype in (torch.bfloat16, torch.float16):
        every = torch.where(every >= 1 << 15, every - (1 << 16), every).to(torch.int16)
    else:
        every = every.to(torch.uint8)
    values = every.view(dtype)
    finite = values[torch.isfinite(values.float())]
    out = stochastic_round(K, finite.float(), dtype)
    assert torch.equal(_bits(out), _bits(finite))  # -0 stays -0, subnormals stay


@pytest.mark.parametrize("dtype", TARGETS)
def test_nan_and_infinities(dtype):
    x = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")] * 8)
    out = stochastic_round(K, x, dtype).float()
    assert out[::4].isnan().all() and out[1::4].isnan().all()
    if dtype == torch.float8_e4m3fn:  # no infinity: NaN
        assert out[2::4].isnan().all() and out[3::4].isnan().all()
    else:
        assert (out[2::4] == float("inf")).all() and (out[3::4] == -float("inf")).all()


def test_overflow_near_the_largest_finite_value():
    for dtype, largest, step in ((torch.bfloat16, 3.3895313892515355e38, 2.0**120),
                                 (torch.float16, 65504.0, 32.0), (torch.float8_e5m2, 57344.0, 8192.0)):
        x = torch.tensor([largest + step / 2] * 4096, dtype=torch.float64)
        out = stochastic_round(K, x, dtype).double()
        assert set(out.tolist()) == {largest, float("inf")}  # rounds to the largest or overflows, p = 1/2
        assert 1800 < int(torch.isinf(out).sum()) < 2300
        assert torch.isinf(stochastic_round(K, torch.full((64,), -(largest + step), dtype=torch.float64), dtype)).all()
        assert (stochastic_round(K, torch.full((64,), -largest, dtype=torch.float64), dtype).double() == -largest).all()
    # float8_e4m3fn saturates: everything from 448 up (finite) is 448
    x = torch.tensor([448.0, 460.0, 479.9, 480.0, 1e6, -500.0] * 16)
    out = stochastic_round(K, x, torch.float8_e4m3fn).float()
    assert (out.abs() == 448).all() and (out[5::6] == -448).all()


def test_negative_values_round_by_magnitude_and_keep_their_sign():
    x = _data((512,), scale=2.0)
    for dtype in TARGETS:
        pos = stochastic_round(K, x.abs(), dtype)
        neg = stochastic_round(K, -x.abs(), dtype)
        assert torch.equal(neg.float(), -pos.float())
        assert (torch.signbit(neg.float()) | (x == 0)).all()
    tiny = torch.full((256,), -2.0 ** -30)  # far below float16's step 2**-24 near zero: -0 or -2**-24
    out = stochastic_round(K, tiny, torch.float16).float()
    assert torch.signbit(out).all() and set(out.tolist()) <= {0.0, -(2.0**-24)}


def test_zeros_and_subnormals():
    x = torch.tensor([0.0, -0.0] * 8)
    for dtype in TARGETS:
        out = stochastic_round(K, x, dtype).float()
        assert (out == 0).all() and torch.equal(torch.signbit(out), torch.signbit(x))
    # a binary32 subnormal to bfloat16 (same exponent range): between two bfloat16 subnormals
    sub = torch.full((4096,), 1.5 * 2.0**-133)
    out = stochastic_round(K, sub, torch.bfloat16).double()
    assert set(out.tolist()) == {2.0**-133, 2.0**-132}
    # below 2**-32 of float16's smallest step: always rounds to zero
    assert (stochastic_round(K, torch.full((256,), 2.0**-57), torch.float16) == 0).all()


# ---------------------------------------------------------------------------------------------- errors, RNG


def test_errors_name_what_is_wrong():
    x = torch.zeros(4, 3)
    with pytest.raises(TypeError, match="x must be float32 or float64, got torch.bfloat16"):
        stochastic_round(K, x.bfloat16(), torch.bfloat16)
    with pytest.raises(TypeError, match="dtype must be one of .*got torch.float32"):
        stochastic_round(K, x, torch.float32)
    with pytest.raises(TypeError, match="a region needs the global_shape"):
        stochastic_round(K, x, torch.bfloat16, region=(slice(0, 4), slice(None)))
    with pytest.raises(ValueError, match=r"x has shape \(4, 3\) but the region of global shape \(8, 3\) has shape \(8, 3\)"):
        stochastic_round(K, x, torch.bfloat16, global_shape=(8, 3))
    with pytest.raises(ValueError, match="out has shape"):
        stochastic_round(K, x, torch.bfloat16, out=torch.empty(3, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="key"):
        stochastic_round(7, x, torch.bfloat16)


def test_the_global_rng_is_untouched():
    state = torch.get_rng_state()
    stochastic_round(K, _data((64,)), torch.float16)
    assert torch.equal(torch.get_rng_state(), state)
