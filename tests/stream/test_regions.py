"""Regions: any region of a keyed tensor equals the same region of the full draw, bit for bit.

The reference for "the same region" is numpy.ix_ applied to the full draw
(conftest.index_full), not keyinit.regions, so these tests check the region
machinery against an independent definition.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keyinit
try:  # tests/ as a package (tests/__init__.py) or as a plain directory
    from tests.conftest import assert_bits_equal, index_full
except ImportError:
    from conftest import assert_bits_equal, index_full
from keyinit._draw import reference_fill
from keyinit._bits.philox import stream_words
from keyinit.distributions import Normal, Randint
from keyinit.regions import MAX_NUMEL, Region, make_region

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

seeds = st.integers(0, 2**64 - 1)
shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@st.composite
def region_entry(draw, size: int):
    kind = draw(st.sampled_from(["slice", "list", "tensor", "full"]))
    if kind == "full":
        return slice(None)
    if kind == "slice":
        bound = st.one_of(st.none(), st.integers(-size - 2, size + 2))
        step = draw(st.one_of(st.none(), st.integers(-4, 4).filter(bool)))
        return slice(draw(bound), draw(bound), step)
    indices = draw(st.lists(st.integers(-size, size - 1), max_size=6)) if size else []
    if kind == "list":
        return indices
    dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.int16]))
    return torch.tensor(indices, dtype=dtype)


@st.composite
def shape_and_region(draw):
    shape = draw(shapes)
    if draw(st.booleans()) and draw(st.booleans()):
        return shape, None
    return shape, tuple(draw(region_entry(size)) for size in shape)


# ---------------------------------------------------------------- region == full[region]


@SETTINGS
@given(seed=seeds, shape_region=shape_and_region())
def test_region_equals_indexed_full_draw(sampler, seed, shape_region):
    shape, region = shape_region
    k = keyinit.key(seed)
    full = sampler(k, shape)
    assert full.dtype == sampler.dtype and tuple(full.shape) == shape
    part = sampler(k, shape, region=region)
    expected = full if region is None else index_full(full, region)
    assert_bits_equal(part, expected)


@settings(max_examples=40, deadline=None)
@given(seed=seeds, data=st.data())
def test_full_draw_is_concatenation_of_odd_pieces(base_sampler, seed, data):
    k = keyinit.key(seed)
    rows = data.draw(st.integers(1, 40), label="rows")
    cols = data.draw(st.integers(1, 9), label="cols")
    full = base_sampler(k, (rows, cols))
    # cut dim 0 into pieces of odd sizes (the last piece takes the remainder)
    pieces, start = [], 0
    while start < rows:
        size = min(2 * data.draw(st.integers(0, 4), label="half") + 1, rows - start)
        pieces.append(base_sampler(k, (rows, cols), region=(slice(start, start + size), slice(None))))
        start += size
    assert_bits_equal(torch.cat(pieces, dim=0), full)
    # and dim 1, with odd offsets
    cut = data.draw(st.integers(0, cols), label="cut")
    left = base_sampler(k, (rows, cols), region=(slice(None), slice(0, cut)))
    right = base_sampler(k, (rows, cols), region=(slice(None), slice(cut, None)))
    assert_bits_equal(torch.cat([left, right], dim=1), full)
    # flat view: element i of a 1-D draw of numel elements is element i of the 2-D draw
    flat = base_sampler(k, (rows * cols,))
    assert_bits_equal(flat.reshape(rows, cols), full)


# ---------------------------------------------------------------- explicit semantics


def test_region_examples_follow_numpy_ix(base_sampler):
    k = keyinit.key(77)
    shape = (5, 6, 3)
    full = base_sampler(k, shape)
    f = full.numpy() if full.dtype not in (torch.bfloat16,) else None
    regions = [
        (slice(None), slice(None), slice(None)),
        ([4, 0, 4], slice(1, None, 2), [-1]),            # repeats, order, negative index
        (slice(None, None, -1), [], slice(None)),         # negative step, empty entry
        (torch.tensor([3, -5]), slice(5, 0, -2), torch.tensor([2], dtype=torch.int32)),
        ([0], [0], [0]),                                  # never drops a dimension
    ]
    for region in regions:
        part = base_sampler(k, shape, region=region)
        assert_bits_equal(part, index_full(full, region))
        if f is not None:
            lists = [np.arange(n)[e] if isinstance(e, slice) else np.asarray(e, dtype=np.int64).reshape(-1)
                     for e, n in zip(region, shape)]
            assert part.shape == f[np.ix_(*lists)].shape


def test_zero_dim_and_zero_size_shapes(base_sampler):
    k = keyinit.key(3)
    scalar = base_sampler(k, ())
    assert scalar.shape == () and scalar.dtype == base_sampler.dtype
    assert_bits_equal(base_sampler(k, (), region=()), scalar)
    # the single element of a 0-d draw is flat index 0, i.e. element 0 of any draw
    assert_bits_equal(scalar.reshape(1), base_sampler(k, (9,))[:1])
    empty = base_sampler(k, (4, 0, 3))
    assert empty.shape == (4, 0, 3)
    assert base_sampler(k, (4, 5), region=([], slice(None))).shape == (0, 5)


def test_region_object_is_reused_and_checked():
    k = keyinit.key(5)
    region = make_region((6, 4), ([1, 5], slice(None, None, 3)))
    assert region.region_shape == (2, 2) and region.strides == (4, 1) and region.numel == 4
    assert region.flat_indices(0, 4).tolist() == [4, 7, 20, 23]
    assert_bits_equal(keyinit.random.normal(k, (6, 4), region=region),
                      keyinit.random.normal(k, (6, 4), region=([1, 5], slice(None, None, 3))))
    with pytest.raises(ValueError, match=r"region was made for shape \(6, 4\), not \(4, 6\)"):
        keyinit.random.normal(k, (4, 6), region=region)


def test_results_independent_of_chunking(base_sampler):
    k = keyinit.key(11)
    shape = (13, 7)
    region = make_region(shape, (slice(None, None, -1), [6, 0, 3, 3]))
    expected = base_sampler(k, shape, region=region)
    dist = _dist_of(base_sampler, expected.dtype)
    for chunk in (1, 5, 16):
        out = torch.empty_like(expected)
        reference_fill.fill(out, dist, k, region, chunk_elements=chunk)
        assert_bits_equal(out, expected)


def _dist_of(sampler, dtype):
    from keyinit import distributions as d

    kw = sampler.kwargs
    return {
        "bits": lambda: d.Bits(),
        "uniform": lambda: d.Uniform.create(kw.get("low", 0.0), kw.get("high", 1.0)),
        "normal": lambda: d.Normal.create(kw.get("mean", 0.0), kw.get("std", 1.0)),
        "truncated_normal": lambda: d.TruncatedNormal.create(
            kw.get("mean", 0.0), kw.get("std", 1.0), kw.get("a", -2.0), kw.get("b", 2.0), dtype),
        "bernoulli": lambda: d.Bernoulli.create(kw.get("p", 0.5)),
        "randint": lambda: d.Randint.create(kw["low"], kw["high"], dtype),
    }[sampler.name]()


# ---------------------------------------------------------------- out=


def test_non_contiguous_out_equals_contiguous_result(base_sampler):
    k = keyinit.key(21)
    shape = (7, 5)
    expected = base_sampler(k, shape)
    # a transposed view: out[i, j] lives at storage j * 7 + i
    storage = torch.zeros(5, 7, dtype=base_sampler.dtype)
    out = storage.T
    assert not out.is_contiguous()
    result = base_sampler(k, shape, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert_bits_equal(out.contiguous(), expected)
    # a strided view with a storage offset: every other column of a wider tensor; the rest untouched
    sentinel = torch.ones(1, dtype=base_sampler.dtype)
    wide = sentinel.expand(8, 11).clone()
    view = wide[1:, 1::2][:, :5]
    base_sampler(k, shape, out=view)
    assert_bits_equal(view.contiguous(), expected)
    mask = torch.ones(8, 11, dtype=torch.bool)
    mask[1:, 1:11:2] = False
    assert torch.equal(wide[mask], sentinel.expand(int(mask.sum())))


def test_out_region_shape_with_region(base_sampler):
    k = keyinit.key(22)
    shape = (9, 4)
    region = ([8, 2, 2], slice(None, None, -1))
    out = torch.empty(4, 3, dtype=base_sampler.dtype).T
    base_sampler(k, shape, region=region, out=out)
    assert_bits_equal(out.contiguous(), index_full(base_sampler(k, shape), region))


# ---------------------------------------------------------------- huge shapes, far indices


def _flat_of(shape, rows, cols):
    return [r * shape[1] + c for r in rows for c in cols]


def test_far_region_of_huge_shape_matches_stream_words():
    # shape has 2**34 elements: never allocated. Flat indices around 2**33.
    shape = (2**20, 2**14)
    k = keyinit.key_for(1, "tok_embeddings.weight")
    rows = [2**19 - 1, 2**19, 2**20 - 1]
    cols = [2**14 - 3, 2**14 - 1, 0, 5]
    flat = torch.tensor(_flat_of(shape, rows, cols), dtype=torch.int64)
    assert int(flat[3]) == 2**33 - 2**14 + 5 and 2**33 in [r * 2**14 for r in rows]

    got_bits = keyinit.random.bits(k, shape, region=(rows, cols))
    (words,) = stream_words(k.words, flat, 1)
    assert got_bits.flatten().tolist() == words.tolist()

    got_normal = keyinit.random.normal(k, shape, mean=0.5, std=2.0, region=(rows, cols))
    assert_bits_equal(got_normal.flatten(), Normal.create(0.5, 2.0).transform([words]))

    got_randint = keyinit.random.randint(k, shape, low=-7, high=1000, region=(rows, cols))
    assert torch.equal(got_randint.flatten(), Randint.create(-7, 1000, torch.int64).transform(stream_words(k.words, flat, 2)))


def test_last_elements_of_largest_shape():
    # numel == MAX_NUMEL == 2**62 is allowed; its last element is word 2**62 - 1 (bits) or
    # words 2**63 - 2 and 2**63 - 1 (randint): the Philox block counter uses its high word.
    from keyinit._bits.philox import philox4x32

    k = keyinit.key(2**64 - 1)
    shape = (2**31, 2**31)
    assert math.prod(shape) == MAX_NUMEL
    got = keyinit.random.bits(k, shape, region=([-1], [-2, -1]))
    block = (2**62 - 1) // 4
    lanes = philox4x32((block & 0xFFFFFFFF, block >> 32, 0, 0), k.words)
    assert got.flatten().tolist() == [lanes[2], lanes[3]]

    got = keyinit.random.randint(k, shape, low=0, high=2**32, region=([-1], [-1]))
    word_block = (2 * (2**62 - 1)) // 4
    lanes = philox4x32((word_block & 0xFFFFFFFF, word_block >> 32, 0, 0), k.words)
    v = lanes[2] + lanes[3] * 2**32
    assert int(got) == (v * 2**32) >> 64


def test_region_machinery_is_used_not_full_draw():
    # a region of a 2**40-element tensor returns quickly and with the region's shape only
    k = keyinit.key(9)
    out = keyinit.random.uniform(k, (2**20, 2**20), region=(slice(2**19, 2**19 + 2), slice(-3, None)))
    assert out.shape == (2, 3)


def test_region_type_is_normalized_region():
    region = make_region((3,), None)
    assert isinstance(region, Region) and region.indices[0].tolist() == [0, 1, 2]


# ---------------------------------------------------------------- lazy entries


@st.composite
def lazy_shape_and_region(draw):
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    region = []
    for size in shape:
        kind = draw(st.sampled_from(["slice", "range", "list", "tensor"]))
        if kind == "slice":
            step = draw(st.sampled_from([None, 1, 2, -1, -3]))
            region.append(slice(draw(st.one_of(st.none(), st.integers(-size, size))),
                                draw(st.one_of(st.none(), st.integers(-size, size))), step))
        elif kind == "range":
            start = draw(st.integers(-size, size - 1))
            step = draw(st.sampled_from([1, 2, -1, -2]))
            count = draw(st.integers(0, 4))
            values = [start + step * i for i in range(count)]
            if any(not -size <= v < size for v in values):
                values = []
            region.append(range(start, start + step * len(values), step) if values else range(0))
        else:
            values = draw(st.lists(st.integers(-size, size - 1), max_size=5))
            region.append(values if kind == "list" else torch.tensor(values, dtype=torch.int64))
    return shape, tuple(region)


@SETTINGS
@given(shape_region=lazy_shape_and_region())
def test_lazy_entries_index_like_numpy_ix(shape_region):
    """Region entries (ranges or index tensors) give numpy.ix_'s indices and flat indices."""
    shape, region = shape_region
    normalized = make_region(shape, region)
    lists = [np.arange(size)[e] if isinstance(e, slice)
             else np.asarray(list(e) if isinstance(e, range) else
                             (e.tolist() if isinstance(e, torch.Tensor) else e), dtype=np.int64) % max(size, 1)
             for e, size in zip(region, shape)]
    assert normalized.region_shape == tuple(len(v) for v in lists)
    for k, (entry, values) in enumerate(zip(normalized.entries, lists)):
        assert normalized.indices[k].tolist() == values.tolist()
        if isinstance(region[k], slice):
            assert normalized.is_range(k) and isinstance(entry, range)
        if isinstance(entry, range):
            assert list(entry) == values.tolist()
        else:
            assert entry.dtype == torch.int64 and entry.device.type == "cpu" and entry.is_contiguous()
    flat = np.ravel_multi_index(np.ix_(*lists), shape).reshape(-1) if normalized.numel else np.zeros(0)
    assert normalized.flat_indices(0, normalized.numel).tolist() == flat.tolist()
    if normalized.numel > 2:
        assert normalized.flat_indices(1, normalized.numel - 1).tolist() == flat[1:-1].tolist()


def test_range_and_list_entries_draw_the_same_values(base_sampler):
    k = keyinit.key(31)
    shape = (11, 13)
    as_range = base_sampler(k, shape, region=(range(10, -1, -4), range(2, 13, 3)))
    as_list = base_sampler(k, shape, region=([10, 6, 2], [2, 5, 8, 11]))
    as_tensor = base_sampler(k, shape, region=(torch.tensor([10, 6, 2]), torch.tensor([2, 5, 8, 11])))
    assert_bits_equal(as_range, as_list)
    assert_bits_equal(as_tensor, as_list)
    assert_bits_equal(as_list, index_full(base_sampler(k, shape), ([10, 6, 2], [2, 5, 8, 11])))
