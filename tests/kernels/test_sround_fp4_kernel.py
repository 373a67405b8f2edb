"""The compiled CPU rounding to FP4 E2M1 (``keyinit_sround``'s binary64 target, ``fill/sround_fp4.h``;
``keyinit._kernels.fill.cpu.sround_fp4``) gives the reference's codes (``keyinit._draw.reference_sround.
round_fp4_into``, ``docs/spec.md`` 17.7) for every kind of binary64 quotient (zeros, subnormals, tiny values
that only round to 0 or 0.5, each E2M1 value, boundary and midpoint and their neighbours, every exponent,
6 and past it, infinities), over dense, strided, reversed, listed and transposed regions and sources and
several thread counts; its golden digests are the reference's; ``keyinit.random.stochastic_round_fp4``
uses it on CPU (the golden vectors of 17.7 and a DTensor's shards included) and falls back to the
reference."""

from __future__ import annotations

import math
import os

import pytest
import torch

import keyinit
from keyinit._draw import dispatch, reference_sround
from keyinit._kernels.fill import cpu as _cpu
from keyinit._kernels.fill import selftest_sround
from keyinit._kernels.fill.selftest import KEY_WORDS, digest
from keyinit.keys import Key
from keyinit.random import stochastic_round_fp4
from keyinit.regions import make_region
from tests._support.dist import requires_gloo, run_distributed
from tests.kernels.test_sround_kernel import REGIONS

_ON_CI = os.environ.get("CI", "").lower() == "true"
_KERNEL = _cpu.unchecked_library()
pytestmark = pytest.mark.skipif(
    _KERNEL is None and not _ON_CI, reason=f"compiled CPU kernel unavailable: {_cpu.UNCHECKED.failure}"
)

KEY = keyinit.key(20240612)
#: E2M1's values and the midpoints between neighbours, with 0.25 (half of the first step) and 7 (past 6).
BOUNDARIES = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0]


@pytest.fixture(autouse=True)
def _kernel():
    if _KERNEL is None:
        pytest.fail(f"CI=true and the compiled CPU kernel cannot be built: {_cpu.UNCHECKED.failure}")


def _reference(v, key, reg):
    out = torch.empty(reg.region_shape, dtype=torch.uint8)
    reference_sround.round_fp4_into(out, v, key, reg)
    return out


def _kernel_round(v, key, reg, threads=1, out=None):
    out = torch.empty(reg.region_shape, dtype=torch.uint8) if out is None else out
    assert _cpu.sround_fp4(out, v, key, reg, threads=threads, lib=_KERNEL)
    return out


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int64).view(torch.float64)


def _every_kind() -> torch.Tensor:
    """Every sign and exponent field (each top-16-bit pattern, NaNs left out, with four low parts), every
    pattern within 512 ulps of each boundary (both signs), the smallest and largest subnormals' neighbours,
    and 2**-k for every k the binary64 range has (R = 2**(33-k) halves down to 0)."""
    top = torch.arange(1 << 16, dtype=torch.int64) << 48
    top = top[(top & 0x7FF0000000000000) != 0x7FF0000000000000]
    patterns = [top, top | 1, top | 0x0000800000000000, top | 0x0000FFFFFFFFFFFF]
    for b in BOUNDARIES + [5e-324, 2.0 ** -1022]:
        centre = torch.tensor([b], dtype=torch.float64).view(torch.int64)
        near = centre + torch.arange(-512, 513, dtype=torch.int64)
        near = near[near >= 0]
        patterns += [near, near | (-(1 << 63))]
    powers = torch.tensor([2.0 ** -k for k in range(-2, 1075)], dtype=torch.float64)
    patterns += [powers.view(torch.int64), (-powers).view(torch.int64)]
    patterns.append(torch.tensor([float("inf"), float("-inf"), 1e308, -1e308], dtype=torch.float64).view(torch.int64))
    return _from_bits(torch.cat(patterns))


def test_the_golden_digests_are_the_references():
    key = Key(*KEY_WORDS)
    names = []
    for name, shape, region, layout, _ in selftest_sround.fp4_cases():
        reg = make_region(shape, region)
        v = selftest_sround.fp4_inputs(reg.numel).reshape(reg.region_shape)
        out = selftest_sround._empty(reg.region_shape, torch.uint8, layout)
        reference_sround.round_fp4_into(out, v, key, reg)
        assert digest(out) == selftest_sround.GOLDEN_FP4[name], name
        names.append(name)
    assert sorted(names) == sorted(selftest_sround.GOLDEN_FP4)
    assert not torch.isnan(selftest_sround.fp4_inputs(70001)).any()  # the caller refuses NaN: none here
    assert selftest_sround.run_fp4(lambda o, v, k, r, t: _cpu.sround_fp4(o, v, k, r, threads=t, lib=_KERNEL)) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_kind_of_binary64_value(seed):
    """The kernel's codes are the reference's for each value below, with three keys (different words)."""
    v = _every_kind()
    reg = make_region((v.numel(),), None)
    k = keyinit.key(seed)
    got = _kernel_round(v, k, reg, threads=2)
    assert torch.equal(got, _reference(v, k, reg))
    assert int(got.max()) <= 15
    assert torch.equal(got >= 8, torch.signbit(v))  # sign-magnitude: the sign is kept, zeros included
    assert (got[v.abs() >= 6] & 7 == 7).all()  # saturation, infinities included
    assert (got[v.abs() < 2.0 ** -34] & 7 == 0).all()  # R = 0: never rounds up


def test_each_e2m1_value_is_kept_and_a_midpoint_goes_either_way():
    values = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    v = torch.cat([values, -values]).repeat_interleave(64)
    reg = make_region((v.numel(),), None)
    got = _kernel_round(v, KEY, reg)
    assert torch.equal(got.reshape(14, 64), torch.tensor([1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15],
                                                         dtype=torch.uint8)[:, None].expand(14, 64))
    mid = torch.full((4096,), 2.5, dtype=torch.float64)
    codes = _kernel_round(mid, KEY, make_region((4096,), None))
    assert set(codes.tolist()) == {4, 5} and abs(int((codes == 5).sum()) - 2048) < 5 * 32


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1031, 70001])
def test_whole_tensors_of_odd_sizes(n):
    v = selftest_sround.fp4_inputs(n + 40)[40:] * 3.0
    reg = make_region((n,), None)
    assert torch.equal(_kernel_round(v, KEY, reg, threads=2), _reference(v, KEY, reg))


@pytest.mark.parametrize("shape,region", REGIONS, ids=[f"region{i}" for i in range(len(REGIONS))])
def test_regions_give_the_whole_tensors_codes(shape, region):
    reg = make_region(shape, region)
    small = max(shape) < 1000
    flat = reg.flat_indices(0, reg.numel)
    if small:
        full = selftest_sround.fp4_inputs(math.prod(shape))
        v = full[flat].reshape(reg.region_shape)
    else:
        v = selftest_sround.fp4_inputs(reg.numel).reshape(reg.region_shape)
    got = _kernel_round(v, KEY, reg)
    assert torch.equal(got, _reference(v, KEY, reg))
    if small:
        whole = _kernel_round(full, KEY, make_region((full.numel(),), None))
        assert torch.equal(got.reshape(-1), whole[flat])


def test_strided_sources_and_destinations():
    """A transposed, sliced, broadcast or negated-view source, a transposed or gapped destination: the codes
    of the contiguous case."""
    reg = make_region((33, 65), None)
    v = selftest_sround.fp4_inputs(33 * 65).reshape(33, 65)
    expected = _reference(v, KEY, reg)
    sources = [v, v.t().contiguous().t(), torch.zeros(33, 130, dtype=torch.float64)[:, ::2].copy_(v)]
    outs = [lambda: torch.empty(33, 65, dtype=torch.uint8), lambda: torch.empty(65, 33, dtype=torch.uint8).t(),
            lambda: torch.empty(33, 130, dtype=torch.uint8)[:, 1::2]]
    for source in sources:
        for make in outs:
            out = make()
            _kernel_round(source, KEY, reg, out=out)
            assert torch.equal(out, expected)
    neg = torch._neg_view(v.neg())
    assert neg.is_neg() and torch.equal(_kernel_round(neg, KEY, reg), expected)
    row = v[:1].expand(33, 65)  # stride 0: every row the first
    assert torch.equal(_kernel_round(row, KEY, reg), _reference(row.contiguous(), KEY, reg))


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_thread_counts_give_the_same_codes(threads):
    reg = make_region((3, 70001), (slice(None), slice(5, None)))
    v = selftest_sround.fp4_inputs(reg.numel).reshape(reg.region_shape)
    assert torch.equal(_kernel_round(v, KEY, reg, threads=threads), _reference(v, KEY, reg))


def test_what_the_kernel_declines():
    reg = make_region((8,), None)
    v = torch.ones(8, dtype=torch.float64)
    assert not _cpu.sround_fp4(torch.empty(8, dtype=torch.uint8), v.float(), KEY, reg, lib=_KERNEL)
    assert not _cpu.sround_fp4(torch.empty(8, dtype=torch.int8), v, KEY, reg, lib=_KERNEL)
    v1 = _kernel_round(v, keyinit.key(3), reg)
    assert torch.equal(_kernel_round(v, keyinit.key(3, stream="v2"), reg), v1)  # v2 rounds as v1


def test_the_family_is_registered_for_both_streams():
    for stream in ("v1", "v2"):
        family = dispatch.kernels(stream, "sround_fp4")
        assert (family.reference.module, family.reference.name) == ("keyinit._draw.reference_sround",
                                                                    "round_fp4_into")
        assert (family.devices["cpu"].module, family.devices["cpu"].name) == ("keyinit._kernels.fill.cpu",
                                                                              "sround_fp4")
        assert family.devices["cuda"].module == "keyinit._kernels.fill.triton_sround"


def _count_reference(monkeypatch) -> list:
    calls = []
    original = reference_sround.round_fp4_into
    monkeypatch.setattr(reference_sround, "round_fp4_into", lambda *a, **k: (calls.append(1), original(*a, **k)))
    return calls


def test_stochastic_round_fp4_uses_the_kernel_and_falls_back(monkeypatch):
    x = keyinit.random.normal(keyinit.key(5), (40, 32), std=3.0)
    scale = torch.exp2(torch.arange(-2, 2).repeat(10)).reshape(40, 1)
    expected = _reference(x.double() / scale.double(), KEY, make_region((40, 32), None))
    calls = _count_reference(monkeypatch)
    fast = stochastic_round_fp4(KEY, x, scale)
    assert calls == [] and torch.equal(fast, expected)
    monkeypatch.setenv("KEYINIT_DISABLE_KERNELS", "1")
    assert torch.equal(stochastic_round_fp4(KEY, x, scale), fast) and calls == [1]


def test_the_golden_vectors_go_through_the_kernel(monkeypatch):
    """17.7's golden vectors (``tests/sround/golden_sround_fp4_v1.json``) through the public function, whole
    and as a region, with the reference unreachable."""
    from tests.sround import test_sround_fp4 as golden

    calls = _count_reference(monkeypatch)
    for index in range(len(golden.CASES)):
        golden.test_the_implementation_gives_the_golden_codes(index)
    assert calls == []


def _dtensor_rank(seed: int):
    """One rank: its shard of ``stochastic_round_fp4`` of a DTensor sharded by columns (uneven) with the
    reference unreachable."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    reference_sround.round_fp4_into = refuse
    mesh = init_device_mesh("cpu", (2,))
    x = keyinit.random.normal(keyinit.key(seed), (6, 9), std=4.0)
    codes = stochastic_round_fp4(KEY, distribute_tensor(x, mesh, [Shard(1)]), 0.5)
    return codes.to_local().clone()


@requires_gloo
def test_a_dtensors_shards_round_as_the_whole_tensor():
    x = keyinit.random.normal(keyinit.key(8), (6, 9), std=4.0)
    whole = stochastic_round_fp4(KEY, x, 0.5)
    shards = run_distributed(_dtensor_rank, 2, args=(8,), timeout=120)
    assert torch.equal(torch.cat(shards, dim=1), whole)
