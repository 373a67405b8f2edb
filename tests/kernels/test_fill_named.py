"""The C fill kernel's draws of keyed forwards' random ops under stream v2 (docs/spec.md 14.8,
``keyinit_fill_high``): bit for bit the reference :func:`keyinit._draw.names.fill_named`, for every
distribution a keyed random op uses, one to three coordinates, extent-1 and padded dimensions, listed and
offset regions, strided destinations and threads; the selftest's digests are the reference's.

Values are compared as bytes (the kernel's promise is the reference's bits).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import keyinit
import keyinit.nn as knn
from keyinit._draw import dispatch
from keyinit._draw.names import fill_named, naming
from keyinit._kernels.fill import cpu
from keyinit._kernels.fill import selftest as _selftest
from keyinit.distributions import Bernoulli, Bits, Normal, Randint, TruncatedNormal, Uniform
from keyinit.regions import make_region

KEY = keyinit.Key(0x9E3779B9, 0x7F4A7C15, "v2")

DISTS = {
    "uniform": (Uniform.create(-2.0, 3.0), (torch.float32, torch.bfloat16, torch.float64, torch.float16)),
    "normal": (Normal.create(0.5, 2.0), (torch.float32, torch.bfloat16, torch.float64)),
    "trunc_normal": (TruncatedNormal.create(0.0, 1.0, -2.0, 2.0, torch.float32), (torch.float32,)),
    "bernoulli": (Bernoulli.create(0.3), (torch.bool, torch.float32, torch.bfloat16, torch.int64)),
    "randint": (Randint.create(-3, 1000, torch.int64), (torch.int64, torch.int32)),
    "bits": (Bits(), (torch.int64,)),
}

# (canonical shape, region, sample shape): 0-3 coordinates, extent-1 dims, short rows (inner < 8, the
# kernel's cross-row tiles), the sample innermost of its own (no coordinate), listed samples
SHAPES = [
    ((5, 11), (slice(2, None), slice(None)), (11,)),
    ((3, 6, 33), (slice(None),) * 3, (6, 33)),
    ((4, 3, 5, 3), (slice(1, None),) + (slice(None),) * 3, (3, 5, 3)),
    ((3, 1, 7, 1, 130), (slice(None),) * 5, (1, 7, 1, 130)),
    ((30,), (slice(4, None),), ()),
    ((10, 6, 5), ([4, 1, 1, 9], slice(None), slice(1, None, 2)), (6, 5)),
    ((2, 9, 1), (slice(None),) * 3, (9, 1)),
    ((2, 3, 4, 5, 6), (slice(None),) * 5, (3, 4, 5, 6)),  # four coordinates: c_3 and c_4 share word 2
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _pair(dist, dtype, shape, region, sample_shape, layout="dense", threads=1, key=KEY):
    reg = make_region(shape, region)
    rshape = reg.region_shape

    def empty():
        if layout == "transposed":
            return torch.zeros(tuple(reversed(rshape)), dtype=dtype).permute(*reversed(range(len(rshape))))
        return torch.zeros(rshape, dtype=dtype)

    want, got = empty(), empty()
    with naming(sample_shape):
        assert fill_named(want, dist, key, reg)
    assert cpu.fill_named(got, dist, key, reg, sample_shape, threads=threads)
    return got, want


def _cases():
    for name, (dist, dtypes) in DISTS.items():
        for dtype in dtypes:
            yield pytest.param(dist, dtype, id=f"{name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("dist,dtype", list(_cases()))
@pytest.mark.parametrize("shape,region,sample_shape", SHAPES, ids=lambda v: str(v).replace(" ", ""))
def test_kernel_equals_reference(dist, dtype, shape, region, sample_shape):
    got, want = _pair(dist, dtype, shape, region, sample_shape)
    assert torch.equal(_bytes(got), _bytes(want))


@pytest.mark.parametrize("name", ["uniform", "normal", "bernoulli", "randint"])
def test_listed_positions_equal_reference(name):
    """A lazily evaluated draw's region: row-major positions of the canonical tensor, listed (1-D)."""
    dist, dtypes = DISTS[name]
    sample_shape = (4, 3, 7)
    total = 5 * 4 * 3 * 7
    positions = [total - 1, 0, 13, 14, 15, 16, 2, 2, 84, 85, 86, 87, 88, 300, 301] + list(range(100, 140, 3))
    got, want = _pair(dist, dtypes[0], (total,), (positions,), sample_shape)
    assert torch.equal(_bytes(got), _bytes(want))


def test_transposed_destination_and_threads_equal_reference():
    dist = Normal.create(0.0, 1.0)
    got, want = _pair(dist, torch.float32, (3, 40, 700), (slice(None),) * 3, (40, 700), layout="transposed")
    assert torch.equal(got, want)
    got, want = _pair(dist, torch.bfloat16, (3, 40, 700), (slice(1, None),) + (slice(None),) * 2, (40, 700),
                      threads=2)
    assert torch.equal(_bytes(got), _bytes(want))


def test_samples_near_the_limit_equal_reference():
    big = 2**31
    got, want = _pair(Randint.create(0, 2**31, torch.int64), torch.int64, (big, 3, 70),
                      (slice(big - 2, None), slice(None), slice(None)), (3, 70))
    assert torch.equal(got, want)


def test_padding_and_leading_ones_name_nothing():
    """The names are extent-free: the real part of a sample padded further, and ``(L, D)`` as ``(1, L, D)``,
    draw the same values through the kernel."""
    dist = Normal.create(0.0, 1.0)
    short, _ = _pair(dist, torch.float32, (3, 4, 9), (slice(None),) * 3, (4, 9))
    padded, _ = _pair(dist, torch.float32, (3, 7, 12), (slice(None),) * 3, (7, 12))
    assert torch.equal(padded[:, :4, :9], short)
    leading, _ = _pair(dist, torch.float32, (3, 1, 4, 9), (slice(None),) * 4, (1, 4, 9))
    assert torch.equal(leading[:, 0], short)


def test_errors_are_the_references():
    out = torch.empty(2, 70000, 2, 2, 2)
    region = make_region((2, 70000, 2, 2, 2), None)
    with pytest.raises(ValueError, match="exceeds stream v2's limit of 65536 for coordinate 4 of a sample with 4"):
        cpu.fill_named(out, Uniform.create(0.0, 1.0), KEY, region, (70000, 2, 2, 2))
    big = 2**31
    region = make_region((big + 1, 3), (slice(big, None), slice(None)))
    with pytest.raises(ValueError, match=r"outside stream v2's \[0, 2\*\*31\)"):
        cpu.fill_named(torch.empty(1, 3), Uniform.create(0.0, 1.0), KEY, region, (3,))


def test_selftest_named_digests_are_the_reference_values():
    key = keyinit.Key(*_selftest.KEY_WORDS, "v2")
    names = []
    for name, dist, dtype, shape, region, sample_shape, layout, _threads in _selftest.named_cases():
        reg = make_region(shape, region)
        out = _selftest._empty(reg.region_shape, dtype, layout)
        with naming(sample_shape):
            assert fill_named(out, dist, key, reg)
        assert _selftest.digest(out) == _selftest.NAMED_GOLDEN[name], name
        names.append(name)
    assert sorted(names) == sorted(_selftest.NAMED_GOLDEN)


def test_selftest_named_passes_for_the_loaded_kernel_and_catches_a_wrong_one():
    lib = cpu.library()
    assert _selftest.run_named(lambda out, dist, key, region, sample_shape, threads: cpu.fill_named(
        out, dist, key, region, sample_shape, threads=threads, lib=lib)) == []

    def v1_names(out, dist, key, region, sample_shape, threads):  # the row-major names: another stream
        return cpu.fill(out, dist, key, region, threads=threads, lib=lib)

    assert "named-normal-f32-extent-1" in _selftest.run_named(v1_names)


def test_v2_cpu_fill_kernel_is_v1s_outside_naming_and_the_cuda_one_declines_named_draws():
    region = make_region((5, 7), None)
    v1, v2 = torch.empty(5, 7), torch.empty(5, 7)
    assert cpu.fill(v1, Normal.create(0.0, 1.0), keyinit.Key(3, 4), region)
    assert cpu.fill_v2(v2, Normal.create(0.0, 1.0), keyinit.Key(3, 4, "v2"), region)
    assert torch.equal(v1, v2)
    from keyinit._kernels.fill import triton as fill_triton

    with naming((7,)):
        assert fill_triton.fill_v2(v2, Normal.create(0.0, 1.0), KEY, region) is False


class _Draws(nn.Module):
    def forward(self, x):
        return (torch.randn_like(x), torch.rand_like(x), torch.bernoulli(torch.full_like(x, 0.3)),
                torch.randint_like(x, 0, 50), torch.empty_like(x).uniform_(-1, 1), torch.empty_like(x).normal_(),
                torch.rand(x.shape[0], device=x.device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_keyed_random_ops_through_the_seam_equal_the_reference(dtype, monkeypatch):
    """A keyed forward's random ops under v2: the kernel (the default) and the reference
    (``KEYINIT_DISABLE_KERNELS=1``) give the same bits; the kernel is the one that ran."""
    net = _Draws()
    x = torch.zeros(3, 5, 70, dtype=dtype)
    calls = []
    fill_v2 = cpu.fill_v2
    monkeypatch.setattr(cpu, "fill_v2", lambda *a, **k: calls.append(1) or fill_v2(*a, **k))
    with knn.keyed(net, 0, step=1, sample_offset=4, stream="v2"):
        fast = net(x)
    assert len(calls) == len(fast)
    monkeypatch.setenv("KEYINIT_DISABLE_KERNELS", "1")
    with knn.keyed(net, 0, step=1, sample_offset=4, stream="v2"):
        slow = net(x)
    for a, b in zip(fast, slow):
        assert torch.equal(_bytes(a), _bytes(b))
    assert dispatch.kernels("v2", "fill").devices["cpu"].name == "fill_v2"


# rows of fewer than a tile's 512 elements, contiguous in out, are packed into whole tiles (both streams):
# rows starting off a Philox block, two-word elements, rows across the kernel's 32768-element chunks, and a
# destination with gaps between rows (each row its own tile)
PACKED = [
    ((70, 300), (slice(None), slice(3, 290)), "dense"),
    ((200, 333), (slice(1, None), slice(5, 338 - 5)), "dense"),
    ((9, 8, 130), (slice(None), slice(None), slice(1, 129)), "dense"),
    ((40, 100), (slice(None), slice(2, 99)), "gaps"),
]


@pytest.mark.parametrize("shape,region,layout", PACKED, ids=str)
@pytest.mark.parametrize("name", ["normal", "randint", "bernoulli"])
def test_packed_rows_equal_reference(shape, region, layout, name):
    from keyinit._draw import reference_fill

    dist, dtypes = DISTS[name]
    reg = make_region(shape, region)
    rshape = reg.region_shape

    def empty():
        if layout == "gaps":  # each row of out followed by 3 elements it does not own
            return torch.zeros(rshape[:-1] + (rshape[-1] + 3,), dtype=dtypes[0])[..., :rshape[-1]]
        return torch.zeros(rshape, dtype=dtypes[0])

    for key in (keyinit.Key(5, 6), KEY):
        want, got = empty(), empty()
        reference_fill.fill(want, dist, key, reg)
        assert cpu.fill(got, dist, key, reg, threads=2)
        assert torch.equal(_bytes(got), _bytes(want)), key.stream
    # the same rows by v2's names (the region's dims: the canonical tensor's)
    got, want = _pair(dist, dtypes[0], shape, region, shape[1:])
    assert torch.equal(_bytes(got), _bytes(want))
