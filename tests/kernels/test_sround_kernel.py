"""The compiled CPU stochastic rounding (``keyinit_sround``, ``keyinit._kernels.fill.cpu.sround``) gives the
reference's bits (``keyinit._draw.reference_sround``, ``docs/spec.md`` section 17): whole tensors of odd
sizes, regions (strided, reversed, index lists, off a Philox block), transposed sources and destinations,
every kind of binary32 value, several thread counts; its golden digests are the reference's; and
``keyinit.random.stochastic_round`` uses it on CPU and falls back to the reference."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

import keyinit
from keyinit._draw import dispatch, reference_sround
from keyinit._kernels.fill import cpu as _cpu
from keyinit._kernels.fill import selftest_sround
from keyinit._kernels.fill.selftest import KEY_WORDS, digest
from keyinit.keys import Key
from keyinit.random import stochastic_round
from keyinit.regions import make_region

# Compared case by case, so the library is used whether or not it passed its load-time self-test (as in
# test_kernels_cpu.py): only a missing compiler skips, and under CI=true not even that.
_ON_CI = os.environ.get("CI", "").lower() == "true"
_KERNEL = _cpu.unchecked_library()
pytestmark = pytest.mark.skipif(
    _KERNEL is None and not _ON_CI, reason=f"compiled CPU kernel unavailable: {_cpu.UNCHECKED.failure}"
)

KEY = keyinit.key(20240611)
TARGETS = (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn)
IDS = [str(t).removeprefix("torch.") for t in TARGETS]


@pytest.fixture(autouse=True)
def _kernel():
    if _KERNEL is None:
        pytest.fail(f"CI=true and the compiled CPU kernel cannot be built: {_cpu.UNCHECKED.failure}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.uint8)


def _reference(x, dtype, key, reg):
    out = torch.empty(reg.region_shape, dtype=dtype)
    reference_sround.round_into(out, x, key, reg)
    return out


def _kernel_round(x, dtype, key, reg, threads=1, out=None):
    out = torch.empty(reg.region_shape, dtype=dtype) if out is None else out
    assert _cpu.sround(out, x, key, reg, threads=threads, lib=_KERNEL)
    return out


def _values(n: int, seed: int = 0) -> torch.Tensor:
    """Edge values, then binary32 patterns spread over all 2**32 and values near 1 (every rounding)."""
    spread = selftest_sround.inputs(n)
    k = keyinit.key(seed + 1)
    near = keyinit.random.uniform(k, (n,), low=-3.0, high=3.0)
    pick = keyinit.random.bernoulli(keyinit.fold_in(k, 1), (n,), p=0.5)
    return torch.where(pick & (torch.arange(n) >= len(selftest_sround.EDGES)), near, spread)


def test_the_golden_digests_are_the_references():
    key = Key(*KEY_WORDS)
    names = []
    for name, dtype, shape, region, layout, _ in selftest_sround.cases():
        reg = make_region(shape, region)
        x = selftest_sround.inputs(reg.numel).reshape(reg.region_shape)
        out = selftest_sround._empty(reg.region_shape, dtype, layout)
        reference_sround.round_into(out, x, key, reg)
        assert digest(out) == selftest_sround.GOLDEN[name], name
        names.append(name)
    assert sorted(names) == sorted(selftest_sround.GOLDEN)
    assert selftest_sround.run(lambda o, x, k, r, t: _cpu.sround(o, x, k, r, threads=t, lib=_KERNEL)) == []


@pytest.mark.parametrize("dtype", TARGETS, ids=IDS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1031, 70001])
def test_whole_tensors_of_odd_sizes(dtype, n):
    reg = make_region((n,), None)
    x = _values(n, n)
    assert torch.equal(_bits(_kernel_round(x, dtype, KEY, reg, threads=2)), _bits(_reference(x, dtype, KEY, reg)))


@pytest.mark.parametrize("dtype", TARGETS, ids=IDS)
def test_every_edge_value(dtype):
    """NaN (both signs, payloads), inf, largest finite of binary32 and of each target, subnormals of both,
    negative zero, values below the smallest target subnormal: the kernel and the reference agree for 64
    keys, and NaN stays NaN, zeros keep their sign."""
    edges = torch.tensor(selftest_sround.EDGES, dtype=torch.int64)
    edges = torch.where(edges >= 2**31, edges - 2**32, edges).to(torch.int32).view(torch.float32)
    x = edges.repeat(64)  # 64 words per value
    reg = make_region((x.numel(),), None)
    for seed in range(4):
        k = keyinit.key(seed)
        got = _kernel_round(x, dtype, k, reg)
        assert torch.equal(_bits(got), _bits(_reference(x, dtype, k, reg)))
        wide = got.float()
        assert torch.equal(torch.isnan(wide), torch.isnan(x) | (torch.isinf(x) & (dtype == torch.float8_e4m3fn)))
        zero = x == 0
        assert torch.equal(torch.signbit(wide[zero]), torch.signbit(x[zero]))


REGIONS = [
    ((40, 50), (slice(None, None, 3), slice(1, None, 2))),           # strided
    ((40, 50), (slice(None, None, -1), slice(None, None, -7))),      # reversed
    ((37, 29), ([36, 0, 5, 5, 11], slice(3, 20))),                    # an index list (repeats), a run
    ((37, 29), (slice(2, 9), [28, 1, 2, 3, 4, 0])),                  # listed columns, partly consecutive
    ((7, 300), (slice(None), slice(3, 290))),                         # runs off a Philox block boundary
    ((3, 4, 5, 6), ([1], slice(None), [4, 0], slice(1, None, 2))),   # a one-element list, four dims
    ((2**31, 2**31), (slice(2**31 - 2, None), slice(2**31 - 70, None, 3))),  # indices near 2**62
]


@pytest.mark.parametrize("dtype", TARGETS, ids=IDS)
@pytest.mark.parametrize("shape,region", REGIONS, ids=[f"region{i}" for i in range(len(REGIONS))])
def test_regions_give_the_whole_tensors_values(dtype, shape, region):
    reg = make_region(shape, region)
    small = max(shape) < 1000
    flat = reg.flat_indices(0, reg.numel)
    if small:  # the region's values are the whole tensor's at their global indices
        full = _values(math.prod(shape), 7)
        x = full[flat].reshape(reg.region_shape)
    else:
        x = _values(reg.numel, 7).reshape(reg.region_shape)
    got = _kernel_round(x, dtype, KEY, reg)
    assert torch.equal(_bits(got), _bits(_reference(x, dtype, KEY, reg)))
    if small:  # and the region of the whole tensor's rounding
        whole = _kernel_round(full, dtype, KEY, make_region((full.numel(),), None))
        assert torch.equal(_bits(got).reshape(-1), _bits(whole)[flat])


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=["bfloat16", "float16"])
def test_strided_sources_and_destinations(dtype):
    """A transposed or sliced source, a transposed or gapped destination: the values of the contiguous case."""
    reg = make_region((33, 65), None)
    x = _values(33 * 65, 3).reshape(33, 65)
    expected = _bits(_reference(x, dtype, KEY, reg))
    sources = [x, x.t().contiguous().t(), torch.zeros(33, 130)[:, ::2].copy_(x), -(-x)]
    outs = [lambda: torch.empty(33, 65, dtype=dtype), lambda: torch.empty(65, 33, dtype=dtype).t(),
            lambda: torch.empty(33, 130, dtype=dtype)[:, 1::2]]
    for source in sources:
        for make in outs:
            out = make()
            _kernel_round(source, dtype, KEY, reg, out=out)
            assert torch.equal(_bits(out), expected)
    neg = torch._neg_view(x.neg())  # a view with torch's negative bit: its memory holds -x
    assert neg.is_neg()
    assert torch.equal(_bits(_kernel_round(neg, dtype, KEY, reg)), expected)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_thread_counts_give_the_same_bits(threads):
    reg = make_region((3, 70001), (slice(None), slice(5, None)))
    x = _values(reg.numel, 11).reshape(reg.region_shape)
    for dtype in (torch.bfloat16, torch.float16):
        got = _kernel_round(x, dtype, KEY, reg, threads=threads)
        assert torch.equal(_bits(got), _bits(_reference(x, dtype, KEY, reg)))


def test_streams_v1_and_v2_round_alike_and_other_cases_decline():
    reg = make_region((100,), None)
    x = _values(100)
    v1 = _kernel_round(x, torch.bfloat16, keyinit.key(3), reg)
    v2 = _kernel_round(x, torch.bfloat16, keyinit.key(3, stream="v2"), reg)
    assert torch.equal(_bits(v1), _bits(v2))
    out = torch.empty(100, dtype=torch.bfloat16)
    assert not _cpu.sround(out, x.double(), KEY, reg, lib=_KERNEL)  # float64: the reference
    assert not _cpu.sround(torch.empty(100, dtype=torch.float32), x, KEY, reg, lib=_KERNEL)  # not a target


def test_stochastic_round_uses_the_kernel_and_falls_back(monkeypatch):
    x = _values(1000, 5)
    expected = _reference(x, torch.bfloat16, KEY, make_region((1000,), None))
    calls = []
    original = reference_sround.round_into
    monkeypatch.setattr(reference_sround, "round_into", lambda *a, **k: (calls.append(1), original(*a, **k)))
    fast = stochastic_round(KEY, x, torch.bfloat16)
    assert calls == [] and torch.equal(_bits(fast), _bits(expected))
    stochastic_round(KEY, x.double(), torch.bfloat16)  # float64 sources stay on the reference
    assert calls == [1]
    monkeypatch.setenv("KEYINIT_DISABLE_KERNELS", "1")
    forced = stochastic_round(KEY, x, torch.bfloat16)
    assert calls == [1, 1] and torch.equal(_bits(forced), _bits(fast))


def test_an_unbuildable_library_warns_once_and_rounds_with_the_reference(monkeypatch):
    x = _values(300, 2)
    expected = _reference(x, torch.float16, KEY, make_region((300,), None))
    monkeypatch.setattr(_cpu.LIBRARY, "library", None)
    monkeypatch.setattr(_cpu.LIBRARY, "failure", "BuildError: no C compiler found")
    monkeypatch.setattr(_cpu.LIBRARY, "warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = stochastic_round(KEY, x, torch.float16)
        b = stochastic_round(KEY, x, torch.float16)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "no C compiler" in messages[0]
    assert torch.equal(_bits(a), _bits(expected)) and torch.equal(_bits(b), _bits(expected))


def test_the_family_is_registered_for_both_streams():
    for stream in ("v1", "v2"):
        family = dispatch.kernels(stream, "sround")
        assert family.reference.module == "keyinit._draw.reference_sround"
        assert family.devices["cpu"].module == "keyinit._kernels.fill.cpu"


@pytest.mark.parametrize("dtype", TARGETS, ids=IDS)
def test_every_exponent_and_the_range_boundaries(dtype):
    """Every sign and exponent (each top-16-bit pattern with three low halves) and every pattern within 4096
    of float16's fast-path boundaries (2**-14, 2**16), of float8's, of binary32's largest finite value and of
    infinity: the kernel's bits are the reference's."""
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    patterns = [top, top | 0x0001, top | 0x8000, top | 0xFFFF]
    for centre in (0x38800000, 0x47800000, 0x477FF000, 0x43E80000, 0x47700000, 0x7F7FFFFF, 0x7F800000, 0x00800000):
        for sign in (0, 0x80000000):
            patterns.append(sign | (torch.arange(centre - 4096, centre + 4096, dtype=torch.int64) & 0x7FFFFFFF))
    bits = torch.cat(patterns)
    x = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    reg = make_region((x.numel(),), None)
    assert torch.equal(_bits(_kernel_round(x, dtype, KEY, reg, threads=2)), _bits(_reference(x, dtype, KEY, reg)))
