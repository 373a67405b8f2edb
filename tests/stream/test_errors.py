"""Errors: the exact exception type and a message that says what was expected."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import keyinit
from keyinit import random as kr

K = keyinit.key(0)


def raises(exception, message: str):
    """pytest.raises matching ``message`` literally from its start."""
    return pytest.raises(exception, match="^" + re.escape(message))


# ---------------------------------------------------------------- seeds and keys


@pytest.mark.parametrize("seed, exception, message", [
    (-1, ValueError, "seed must be an int in [0, 2**64), got -1"),
    (2**64, ValueError, "seed must be an int in [0, 2**64), got 18446744073709551616"),
    (True, TypeError, "seed must be an int in [0, 2**64), got bool True"),
    (1.0, TypeError, "seed must be an int in [0, 2**64), got float 1.0"),
    ("1", TypeError, "seed must be an int in [0, 2**64), got str '1'"),
    (None, TypeError, "seed must be an int in [0, 2**64), got NoneType None"),
    (np.bool_(True), TypeError, "seed must be an int in [0, 2**64), got bool"),
    (np.float64(1.0), TypeError, "seed must be an int in [0, 2**64), got float64"),
])
def test_bad_seed(seed, exception, message):
    with raises(exception, message):
        keyinit.key(seed)
    with raises(exception, message):
        keyinit.key_for(seed, "a.b")


def test_bad_stream_and_key_words():
    with raises(ValueError, "unknown stream version 'v3'; this release supports ['v1', 'v2']"):
        keyinit.key(0, stream="v3")
    with raises(ValueError, "key words must be ints in [0, 2**32), got 4294967296"):
        keyinit.Key(2**32, 0)
    with raises(ValueError, "key words must be ints in [0, 2**32), got -1"):
        keyinit.Key(0, -1)


@pytest.mark.parametrize("data, exception, message", [
    (b"x", TypeError, "fold_in data must be an int in [0, 2**64) or a str, got bytes b'x'"),
    (1.5, TypeError, "fold_in data must be an int in [0, 2**64) or a str, got float 1.5"),
    (None, TypeError, "fold_in data must be an int in [0, 2**64) or a str, got NoneType None"),
    (True, TypeError, "fold_in data must be an int in [0, 2**64) or a str, got bool True"),
    (-1, ValueError, "fold_in data must be an int in [0, 2**64), got -1"),
    (2**64, ValueError, "fold_in data must be an int in [0, 2**64), got 18446744073709551616"),
])
def test_fold_in_bad_data(data, exception, message):
    with raises(exception, message):
        keyinit.fold_in(K, data)


@pytest.mark.parametrize("call", [
    lambda: keyinit.fold_in(0, 1),
    lambda: keyinit.split((0, 0)),
    lambda: kr.normal(0, (3,)),
])
def test_not_a_key(call):
    with pytest.raises(TypeError, match=r"^key must be a keyinit.Key \(make one with keyinit.key\(seed\)\), got "):
        call()


@pytest.mark.parametrize("num", [-1, 2.0, True, "2"])
def test_split_bad_num(num):
    with raises(ValueError, f"num must be a non-negative int, got {num!r}"):
        keyinit.split(K, num)


def test_key_for_bad_fqn():
    with raises(TypeError, "fqn must be a str, got int"):
        keyinit.key_for(0, 3)
    with raises(ValueError, "fqn must be non-empty dot-separated names, got 'a..b'"):
        keyinit.key_for(0, "a..b")
    with raises(ValueError, "fqn must be non-empty dot-separated names, got ''"):
        keyinit.key_for(K, "")


# ---------------------------------------------------------------- shapes and regions


@pytest.mark.parametrize("shape, exception, message", [
    ((2, -1), ValueError, "shape must have non-negative sizes, got (2, -1)"),
    (-3, ValueError, "shape must have non-negative sizes, got (-3,)"),
    ((2.0,), TypeError, "shape must be a tuple of ints, got (2.0,)"),
    ((True, 2), TypeError, "shape must be a tuple of ints, got (True, 2)"),
    ("ab", TypeError, "shape must be a tuple of ints, got str"),
    ((2**31, 2**31, 2), ValueError, "shape (2147483648, 2147483648, 2) has more than 2**62 elements"),
])
def test_bad_shape(shape, exception, message):
    with raises(exception, message):
        kr.normal(K, shape)


@pytest.mark.parametrize("region, exception, message", [
    (([3], slice(None)), IndexError, "region entry 0 has index 3, out of bounds for size 3"),
    (([-4], slice(None)), IndexError, "region entry 0 has index -4, out of bounds for size 3"),
    ((slice(None), torch.tensor([0, 4])), IndexError, "region entry 1 has index 4, out of bounds for size 4"),
    ((slice(None), torch.tensor([-5])), IndexError, "region entry 1 has index -5, out of bounds for size 4"),
    (([2**70], slice(None)), IndexError, "region entry 0 has index 1180591620717411303424, out of bounds for size 3"),
    ((slice(None),), ValueError, "region has 1 entries but the shape (3, 4) has 2 dimensions"),
    ((slice(None),) * 3, ValueError, "region has 3 entries but the shape (3, 4) has 2 dimensions"),
    (slice(None), TypeError, "region must be a tuple with one entry per dimension, got slice"),
    ((slice(None), 1), TypeError,
     "region entry 1 must be a slice, a sequence of ints or a 1-D integer tensor, got int"),
    ((slice(None), 1.5), TypeError,
     "region entry 1 must be a slice, a sequence of ints or a 1-D integer tensor, got float"),
    ((slice(None), "01"), TypeError,
     "region entry 1 must be a slice, a sequence of ints or a 1-D integer tensor, got str"),
    ((slice(None), [1.0]), TypeError, "region entry 1 must hold ints, got [1.0]"),
    ((slice(None), [True]), TypeError, "region entry 1 must hold ints, got [True]"),
    ((slice(None), torch.tensor([1.0])), TypeError,
     "region entry 1 must be a 1-D integer tensor, got a 1-D torch.float32 tensor"),
    ((slice(None), torch.tensor([[1]])), TypeError,
     "region entry 1 must be a 1-D integer tensor, got a 2-D torch.int64 tensor"),
    ((slice(None), torch.tensor([True])), TypeError,
     "region entry 1 must be a 1-D integer tensor, got a 1-D torch.bool tensor"),
    ((slice(None, None, 0), slice(None)), ValueError,
     "region entry 0 is a slice with step 0; expected a non-zero step"),
])
def test_bad_region(region, exception, message):
    with raises(exception, message):
        kr.normal(K, (3, 4), region=region)


def test_region_for_zero_dim_shape():
    with raises(ValueError, "region has 1 entries but the shape () has 0 dimensions"):
        kr.normal(K, (), region=([0],))


# ---------------------------------------------------------------- dtypes


UNSUPPORTED = [
    ("bits", lambda dtype: kr.bits(K, (3,), dtype=dtype), torch.float32, "int64"),
    ("uniform", lambda dtype: kr.uniform(K, (3,), dtype=dtype), torch.int32, "float32, float64, bfloat16, float16"),
    ("normal", lambda dtype: kr.normal(K, (3,), dtype=dtype), torch.int64, "float32, float64, bfloat16, float16"),
    ("normal", lambda dtype: kr.normal(K, (3,), dtype=dtype), torch.complex64, "float32, float64, bfloat16, float16"),
    ("truncated_normal", lambda dtype: kr.truncated_normal(K, (3,), dtype=dtype), torch.int32,
     "float32, float64, bfloat16, float16"),
    ("bernoulli", lambda dtype: kr.bernoulli(K, (3,), dtype=dtype), torch.complex64,
     "bool, float32, float64, bfloat16, float16, int64, int32, int16, int8, uint8"),
    ("randint", lambda dtype: kr.randint(K, (3,), low=0, high=2, dtype=dtype), torch.float32,
     "int64, int32, int16, int8, uint8"),
    ("randint", lambda dtype: kr.randint(K, (3,), low=0, high=2, dtype=dtype), torch.bool,
     "int64, int32, int16, int8, uint8"),
]


@pytest.mark.parametrize("name, call, dtype, supported", UNSUPPORTED, ids=[f"{u[0]}-{u[2]}" for u in UNSUPPORTED])
def test_unsupported_dtype(name, call, dtype, supported):
    with raises(TypeError, f"{name} cannot produce dtype {dtype}; supported: {supported}"):
        call(dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_truncated_normal_unsupported_dtype_with_inexact_bounds(dtype):
    # the dtype is checked before the dtype-dependent bounds are computed
    with raises(TypeError, f"truncated_normal cannot produce dtype {dtype}; supported: float32, float64, bfloat16, float16"):
        kr.truncated_normal(K, (3,), a=0.5, b=0.6, dtype=dtype)


@pytest.mark.parametrize("call", [
    lambda: kr.truncated_normal(K, (3,), dtype="float32"),
    lambda: kr.normal(K, (3,), dtype="float32"),
    lambda: kr.randint(K, (3,), low=0, high=3, dtype="float32"),
])
def test_dtype_not_a_torch_dtype(call):
    with raises(TypeError, "dtype must be a torch.dtype, got str 'float32'"):
        call()


# ---------------------------------------------------------------- parameters


@pytest.mark.parametrize("call, exception, message", [
    (lambda: kr.uniform(K, (3,), low=1, high=1), ValueError, "uniform: expected low < high, got low=1.0, high=1.0"),
    (lambda: kr.uniform(K, (3,), low=2.0, high=1.0), ValueError, "uniform: expected low < high, got low=2.0, high=1.0"),
    (lambda: kr.uniform(K, (3,), low=float("nan")), ValueError, "uniform: low must be finite, got nan"),
    (lambda: kr.uniform(K, (3,), high=float("inf")), ValueError, "uniform: high must be finite, got inf"),
    (lambda: kr.uniform(K, (3,), low=-3e38, high=3e38), ValueError, "uniform: high - low=6e+38 overflows float32"),
    (lambda: kr.uniform(K, (3,), low=10**400, high=10**401), ValueError,
     "uniform: low must be finite, got an int too large for a float"),
    (lambda: kr.uniform(K, (3,), low="0"), TypeError, "uniform: low must be a real number, got str"),
    (lambda: kr.normal(K, (3,), std=-1), ValueError, "normal: expected std >= 0, got std=-1.0"),
    (lambda: kr.normal(K, (3,), mean=1e39), ValueError, "normal: mean=1e+39 overflows float32"),
    (lambda: kr.normal(K, (3,), std=torch.tensor(1.0)), TypeError, "normal: std must be a real number, got Tensor"),
    (lambda: kr.normal(K, (3,), mean=True), TypeError, "normal: mean must be a real number, got bool"),
    (lambda: kr.truncated_normal(K, (3,), std=-0.5), ValueError, "truncated_normal: expected std >= 0, got std=-0.5"),
    (lambda: kr.truncated_normal(K, (3,), a=1, b=1), ValueError, "truncated_normal: expected a < b, got a=1.0, b=1.0"),
    (lambda: kr.truncated_normal(K, (3,), a=2, b=-2), ValueError, "truncated_normal: expected a < b, got a=2.0, b=-2.0"),
    (lambda: kr.truncated_normal(K, (3,), a=float("-inf")), ValueError, "truncated_normal: a must be finite, got -inf"),
    (lambda: kr.truncated_normal(K, (3,), a=0.1, b=0.1000000001), ValueError,
     "truncated_normal: no torch.float32 value lies in [a, b] = [0.1, 0.1000000001]"),
    (lambda: kr.truncated_normal(K, (3,), a=0.1, b=0.10009, dtype=torch.bfloat16), ValueError,
     "truncated_normal: no torch.bfloat16 value lies in [a, b] = [0.1, 0.10009]"),
    (lambda: kr.truncated_normal(K, (3,), a=1e300, b=2e300), ValueError,
     "truncated_normal: no torch.float32 value lies in [a, b] = [1e+300, 2e+300]"),
    (lambda: kr.truncated_normal(K, (3,), mean=0, a=7e4, b=8e4, dtype=torch.float16), ValueError,
     "truncated_normal: no torch.float16 value lies in [a, b] = [70000.0, 80000.0]"),
    (lambda: kr.bernoulli(K, (3,), p=1.5), ValueError, "bernoulli: expected p in [0, 1], got p=1.5"),
    (lambda: kr.bernoulli(K, (3,), p=-0.1), ValueError, "bernoulli: expected p in [0, 1], got p=-0.1"),
    (lambda: kr.bernoulli(K, (3,), p=float("nan")), ValueError, "bernoulli: p must be finite, got nan"),
    (lambda: kr.randint(K, (3,), low=3, high=3), ValueError, "randint: expected low < high, got low=3, high=3"),
    (lambda: kr.randint(K, (3,), low=0, high=2**32 + 1), ValueError,
     "randint: high - low must be at most 2**32, got 4294967297"),
    (lambda: kr.randint(K, (3,), low=-(2**40), high=2**40), ValueError,
     "randint: high - low must be at most 2**32, got 2199023255552"),
    (lambda: kr.randint(K, (3,), low=0, high=129, dtype=torch.int8), ValueError,
     "randint: [0, 129) does not fit torch.int8 (range [-128, 127])"),
    (lambda: kr.randint(K, (3,), low=-1, high=3, dtype=torch.uint8), ValueError,
     "randint: [-1, 3) does not fit torch.uint8 (range [0, 255])"),
    (lambda: kr.randint(K, (3,), low=2**63 - 1, high=2**63 + 1), ValueError,
     "randint: [9223372036854775807, 9223372036854775809) does not fit torch.int64"),
    (lambda: kr.randint(K, (3,), low=0.0, high=3), TypeError, "randint: low must be an int, got float"),
    (lambda: kr.randint(K, (3,), low=0, high=np.True_), TypeError, "randint: high must be an int, got bool"),
])
def test_bad_parameters(call, exception, message):
    with raises(exception, message):
        call()


# ---------------------------------------------------------------- out=


@pytest.mark.parametrize("call, exception, message", [
    (lambda: kr.normal(K, (3,), out=torch.empty(4)), ValueError, "out has shape (4,) but the region has shape (3,)"),
    (lambda: kr.normal(K, (3, 4), region=([0], slice(None)), out=torch.empty(3, 4)), ValueError,
     "out has shape (3, 4) but the region has shape (1, 4)"),
    (lambda: kr.normal(K, (3,), dtype=torch.float64, out=torch.empty(3)), TypeError,
     "out has dtype torch.float32 but dtype=torch.float64 was requested"),
    (lambda: kr.randint(K, (3,), low=0, high=2, dtype=torch.int32, out=torch.empty(3, dtype=torch.int64)), TypeError,
     "out has dtype torch.int64 but dtype=torch.int32 was requested"),
    (lambda: kr.normal(K, (3,), out=torch.empty(3, dtype=torch.int64)), TypeError,
     "normal cannot produce dtype torch.int64; supported: float32, float64, bfloat16, float16"),
    (lambda: kr.normal(K, (3,), out=torch.empty(3, device="meta")), ValueError,
     "out is on the meta device; materialize it first (e.g. with to_empty)"),
    (lambda: kr.normal(K, (3,), out=torch.empty(1).expand(3)), ValueError,
     "out has overlapping memory (a zero stride); write into a tensor that owns its elements"),
    (lambda: kr.normal(K, (3,), out=[0.0] * 3), TypeError, "out must be a torch.Tensor, got list"),
    (lambda: kr.truncated_normal(K, (3,), out=np.zeros(3)), TypeError, "out must be a torch.Tensor, got ndarray"),
    (lambda: kr.randint(K, (3,), low=0, high=2, out=[0] * 3), TypeError, "out must be a torch.Tensor, got list"),
])
def test_bad_out(call, exception, message):
    with raises(exception, message):
        call()


def test_failed_call_leaves_out_untouched():
    out = torch.full((2, 3), 7.0)
    with pytest.raises(IndexError):
        kr.normal(K, (4, 3), region=([0, 9], slice(None)), out=out)
    assert torch.equal(out, torch.full((2, 3), 7.0))
