"""Sampler properties: dtype rules, ranges, and independence from threads, processes and SIMD paths."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keyinit
try:  # tests/ as a package (tests/__init__.py) or as a plain directory
    from tests.conftest import BASE_CASES, CASES, ROOT, assert_bits_equal, bit_view
except ImportError:
    from conftest import BASE_CASES, CASES, ROOT, assert_bits_equal, bit_view
from keyinit import random as kr
from keyinit.distributions import Normal, TruncatedNormal, Uniform

MASK32 = 0xFFFFFFFF
LOW_PRECISION = (torch.float64, torch.bfloat16, torch.float16)

seeds = st.integers(0, 2**64 - 1)


# ---------------------------------------------------------------- dtype rules


@settings(max_examples=25, deadline=None, database=None)
@given(seed=seeds, mean=st.floats(-4, 4), std=st.floats(0, 3), low=st.floats(-5, 5), width=st.floats(1e-3, 10))
def test_float_dtypes_are_the_f32_draw_converted(seed, mean, std, low, width):
    k = keyinit.key(seed)
    shape = (3, 17)
    draws = {
        "normal": lambda dtype: kr.normal(k, shape, mean=mean, std=std, dtype=dtype),
        "uniform": lambda dtype: kr.uniform(k, shape, low=low, high=low + width, dtype=dtype),
        # bounds exactly representable in every float dtype, so they do not depend on it
        "truncated_normal": lambda dtype: kr.truncated_normal(k, shape, mean=mean, std=std, a=-2.5, b=3.0, dtype=dtype),
    }
    for name, draw in draws.items():
        reference = draw(torch.float32)
        for dtype in LOW_PRECISION:
            assert_bits_equal(draw(dtype), reference.to(dtype))


def test_float64_is_exactly_widened():
    k = keyinit.key(8)
    f64 = kr.normal(k, (1000,), dtype=torch.float64)
    assert torch.equal(f64.to(torch.float32).to(torch.float64), f64)  # no bits below binary32 precision


def test_truncated_normal_bounds_are_inward_per_dtype():
    # a and b are not representable in bfloat16: rounding the f32 draw could leave [a, b],
    # the bfloat16 draw never does
    k = keyinit.key(99)
    a, b = -0.1, 0.1
    escaped = 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        values = kr.truncated_normal(k, (4000,), mean=0.0, std=1.0, a=a, b=b, dtype=dtype)
        assert values.dtype == dtype
        assert float(values.double().min()) >= a and float(values.double().max()) <= b
        rounded = kr.truncated_normal(k, (4000,), mean=0.0, std=1.0, a=a, b=b).to(dtype).double()
        escaped += int(((rounded < a) | (rounded > b)).sum())
    assert escaped > 0  # the per-dtype bound matters for these a, b


def test_bernoulli_dtypes_are_the_bool_draw_converted():
    k = keyinit.key(4)
    reference = kr.bernoulli(k, (257,), p=0.3)
    assert reference.dtype == torch.bool
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8):
        assert_bits_equal(kr.bernoulli(k, (257,), p=0.3, dtype=dtype), reference.to(dtype))


def test_randint_dtypes_hold_the_same_integers():
    k = keyinit.key(4)
    reference = kr.randint(k, (257,), low=0, high=100)
    assert reference.dtype == torch.int64
    for dtype in (torch.int32, torch.int16, torch.int8, torch.uint8):
        assert torch.equal(kr.randint(k, (257,), low=0, high=100, dtype=dtype), reference.to(dtype))


def test_default_dtypes():
    k = keyinit.key(0)
    assert kr.bits(k, (2,)).dtype == torch.int64
    assert kr.uniform(k, (2,)).dtype == torch.float32
    assert kr.normal(k, (2,)).dtype == torch.float32
    assert kr.truncated_normal(k, (2,)).dtype == torch.float32
    assert kr.bernoulli(k, (2,)).dtype == torch.bool
    assert kr.randint(k, (2,), low=0, high=2).dtype == torch.int64
    # out= decides the dtype when dtype is not given
    assert kr.normal(k, (2,), out=torch.empty(2, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert kr.randint(k, (2,), low=0, high=2, out=torch.empty(2, dtype=torch.int8)).dtype == torch.int8


# ---------------------------------------------------------------- ranges and exact transforms


@settings(max_examples=40, deadline=None, database=None)
@given(seed=seeds, low=st.integers(-(2**40), 2**40), n=st.integers(1, 2**32))
def test_randint_range(seed, low, n):
    values = kr.randint(keyinit.key(seed), (300,), low=low, high=low + n)
    assert int(values.min()) >= low and int(values.max()) < low + n


def test_randint_is_multiply_high_of_two_words():
    k = keyinit.key(31)
    words = kr.bits(k, (2000,)).tolist()
    for n in (1, 2, 3, 10, 65535, 123456789, 2**31 + 1, 2**32 - 1, 2**32):
        got = kr.randint(k, (1000,), low=-5, high=-5 + n).tolist()
        expected = [-5 + (((words[2 * i] + words[2 * i + 1] * 2**32) * n) >> 64) for i in range(1000)]
        assert got == expected


def test_bits_range_and_bernoulli_threshold():
    k = keyinit.key(12)
    words = kr.bits(k, (5000,))
    assert int(words.min()) >= 0 and int(words.max()) <= MASK32
    for p in (0.0, 2**-32, 0.25, 0.5, 1 - 2**-32, 1.0):
        threshold = round(p * 2**32)
        assert torch.equal(kr.bernoulli(k, (5000,), p=p), words < threshold)
    assert not kr.bernoulli(k, (5000,), p=0.0).any() and kr.bernoulli(k, (5000,), p=1.0).all()


def test_bernoulli_threshold_rounds_half_even():
    from keyinit.distributions import Bernoulli

    cases = {0.3: 1288490189, 1 / 3: 1431655765, 0.1: 429496730, 0.0: 0, 1.0: 2**32,
             3 * 2.0**-33: 2, 5 * 2.0**-33: 2, 7 * 2.0**-33: 4}  # the last three are exact ties
    for p, threshold in cases.items():
        dist = Bernoulli.create(p)
        assert dist.threshold == threshold, p
        if 0 < threshold < 2**32:
            edge = torch.tensor([threshold - 1, threshold], dtype=torch.int64)
            assert dist.transform([edge]).tolist() == [True, False]


def test_uniform_range_and_formula():
    k = keyinit.key(13)
    words = kr.bits(k, (5000,))
    u = (words >> 8).to(torch.float32) * 2.0**-24
    values = kr.uniform(k, (5000,))
    assert_bits_equal(values, 0.0 + 1.0 * u)
    assert float(values.min()) >= 0.0 and float(values.max()) < 1.0
    values = kr.uniform(k, (5000,), low=-2.0, high=3.0)
    assert float(values.min()) >= -2.0 and float(values.max()) <= 3.0


def test_normal_sign_bit_and_magnitude_bound():
    # bit 0 is the sign, the rest the magnitude: words x and x ^ 1 give opposite values
    words = torch.tensor([0, 1, 2, 3, 2**31, 2**31 + 1, MASK32 - 1, MASK32, 12345678, 12345679], dtype=torch.int64)
    z = Normal.create(0.0, 1.0).transform([words])
    assert torch.equal(z[0::2], -z[1::2])
    assert (z[0::2] >= 0).all() and (z[1::2] <= 0).all()
    assert float(z.abs().max()) == float(Normal.create(0.0, 1.0).transform([torch.tensor([0])]))
    assert abs(float(z[0]) - 6.337958335876465) == 0.0
    draws = kr.normal(keyinit.key(5), (20_000,))
    assert float(draws.abs().max()) <= 6.337958335876465


@settings(max_examples=60, deadline=None, database=None)
@given(
    seed=seeds,
    mean=st.floats(-50, 50),
    std=st.one_of(st.just(0.0), st.floats(1e-6, 20)),
    a=st.floats(-60, 60),
    width=st.one_of(st.floats(1e-6, 1.0), st.floats(1.0, 80)),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_truncated_normal_always_within_bounds(seed, mean, std, a, width, dtype):
    b = a + width
    try:
        values = kr.truncated_normal(keyinit.key(seed), (64,), mean=mean, std=std, a=a, b=b, dtype=dtype)
    except ValueError as error:  # only when no value of dtype lies in [a, b]
        assert "lies in [a, b]" in str(error)
        return
    wide = values.double()
    assert torch.isfinite(wide).all()
    assert float(wide.min()) >= a and float(wide.max()) <= b


def test_truncated_normal_transform_formula():
    # spec 5.4, written out for a flipped interval
    dist = TruncatedNormal.create(0.0, 1.0, 1.0, 3.0, torch.float32)
    assert dist.flip and dist.lower == 1.0 and dist.upper == 3.0
    words = kr.bits(keyinit.key(1), (64,))
    u = (((words >> 9) << 1) | 1).to(torch.float32) * 2.0**-24
    p = dist.p_low + u * dist.p_span
    from keyinit._bits.fp32math import ndtri_f32

    expected = torch.clamp(0.0 + 1.0 * -ndtri_f32(p), min=1.0, max=3.0)
    assert_bits_equal(dist.transform([words]), expected)


# ---------------------------------------------------------------- threads, processes, SIMD


def _probe_draws() -> dict[str, str]:
    """SHA-256 of the bits of a draw per case, large enough for torch to split work across threads."""
    k = keyinit.key_for(20240601, "layers.0.attention.wq.weight")
    shape = (2, 20_011)  # one chunk of 40022 elements: above torch's 32768-element parallel grain
    return {
        c.id: hashlib.sha256(bit_view(c(k, shape)).numpy().tobytes()).hexdigest()
        for c in BASE_CASES
    } | {
        c.id + "/region": hashlib.sha256(bit_view(c(k, (301, 7), region=(slice(None, None, -3), [6, 0]))).numpy().tobytes()).hexdigest()
        for c in CASES
    }


def test_same_results_with_one_and_two_threads(restore_threads):
    torch.set_num_threads(1)
    one = _probe_draws()
    torch.set_num_threads(2)
    two = _probe_draws()
    assert one == two


_SUBPROCESS = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {root!r})
    sys.path.insert(0, {tests!r})
    import test_random_properties as t
    import keyinit
    keys = {{fqn: keyinit.key_for(7, fqn).words for fqn in ("a.b", "tok_embeddings.weight", "émoji.0")}}
    import torch
    print(torch.backends.cpu.get_cpu_capability())
    print(json.dumps({{"draws": t._probe_draws(), "keys": keys}}))
    """
)


def test_same_results_in_fresh_processes():
    """A fresh interpreter, other hash seeds, and (second run) torch's DEFAULT (no AVX) CPU kernels."""
    expected = {
        "draws": _probe_draws(),
        "keys": {fqn: list(keyinit.key_for(7, fqn).words) for fqn in ("a.b", "tok_embeddings.weight", "émoji.0")},
    }
    code = _SUBPROCESS.format(root=str(ROOT), tests=str(ROOT / "tests" / "stream"))
    # one thread each: the thread count is varied in-process above, and two
    # oversubscribed OpenMP processes on a small shared machine crawl
    environments = [
        {"PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"},
        {"PYTHONHASHSEED": "999", "OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default"},
    ]
    processes = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, **extra}, cwd=str(ROOT), text=True)
        for extra in environments
    ]
    for process, extra in zip(processes, environments):
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
        capability, result = stdout.strip().splitlines()[-2:]
        if "ATEN_CPU_CAPABILITY" in extra:
            assert capability == "DEFAULT"
        assert json.loads(result) == expected, extra


def test_repeated_calls_identical_and_keys_matter():
    k = keyinit.key(3)
    for case in BASE_CASES:
        first, second = case(k, (50,)), case(k, (50,))
        assert_bits_equal(first, second)
        if case.name != "bernoulli":
            assert not torch.equal(bit_view(first), bit_view(case(keyinit.key(4), (50,))))


def test_parameters_do_not_change_the_words_used():
    # every float distribution maps word i to element i: same key, different parameters,
    # same underlying words (so an affine change of parameters is an affine change of values)
    k = keyinit.key(17)
    z = kr.normal(k, (1000,))
    scaled = kr.normal(k, (1000,), mean=0.0, std=2.0)
    assert torch.equal(scaled, 2.0 * z)
    u = kr.uniform(k, (1000,))
    assert torch.equal(kr.uniform(k, (1000,), low=0.0, high=2.0), 2.0 * u)
    assert Uniform.create(0, 2).span == 2.0
