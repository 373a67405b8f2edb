"""Where a local tensor's elements sit in the global stream, and the constants that ``p`` fixes.

A :class:`Layout` is what the ``keyinit::dropout`` op receives besides the
input, the key words and ``p``: for each dimension ``d`` of the local tensor a
global row-major stride ``gstrides[d]`` and either a start (the local index
``i`` is global index ``starts[d] + i``) or an index vector (``indices[d][i]``).
Element ``(i_0, ..., i_{n-1})`` has global flat index
``sum_d gstrides[d] * idx_d(i_d)``. A layout is built from a global shape and a
region (the samplers' convention), from a DTensor's placements, or, in
:func:`keyinit.nn.keyed`, from the batch offset of the local rows.

:func:`make_geometry` turns a layout and a shape into a :class:`Geometry`, the form the
kernels take: size-1 dimensions folded into ``base``, adjacent range dimensions
merged where the inner one is complete (so a contiguous slab of rows is one run
of consecutive indices), plus the keep threshold and the scale.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Optional

import attrs
import torch

from keyinit._draw.geometry import coalesce, coalesce_high
from keyinit._draw.names import V2, check_samples, names_strides
from keyinit.distributions import Bernoulli
from keyinit.keys import DEFAULT_STREAM
from keyinit.regions import MAX_NUMEL, Region, make_region, normalize_shape, row_major_strides

__all__ = ["Layout", "Geometry", "layout_for", "dtensor_layout", "rows_layout", "make_geometry", "ranges_geometry",
           "rows_template", "with_key", "constants"]


class Layout(NamedTuple):
    """Global placement of a local tensor's elements (see the module docstring).

    A NamedTuple rather than an attrs class: it is built inside functions that
    ``torch.compile`` traces, and dynamo constructs tuples but not attrs objects.
    """

    gstrides: tuple[int, ...]
    starts: tuple[int, ...]
    indices: tuple[Optional[torch.Tensor], ...]
    #: Per dimension, what a position adds to the high counter words (``docs/spec.md`` 14.8's extent-free
    #: names: a keyed forward's sample and third coordinate); empty: 0 (every other layout).
    hstrides: tuple[int, ...] = ()


@attrs.frozen(eq=False)
class Geometry:
    """A coalesced layout of a contiguous tensor plus the per-call constants.

    Element ``q`` (row-major over ``sizes``, at position ``(p_0, ...)``) has global index
    ``base + sum_d gstrides[d] * idx_d(p_d)``, ``idx_d(p) = indices[d][p]`` or ``p`` (the
    geometry :func:`keyinit._draw.geometry.coalesce` gives every kernel family); it is kept iff its stream word is
    below ``threshold``; kept values are scaled by ``scale32`` (binary32 and
    16-bit dtypes) or ``scale64`` (float64). The key is ``(k0, k1)`` of stream
    version ``stream`` (a registered name: :mod:`keyinit._draw.dispatch` runs that
    stream's dropout kernels).
    """

    k0: int
    k1: int
    threshold: int
    scale32: float
    scale64: float
    base: int
    sizes: tuple[int, ...]
    gstrides: tuple[int, ...]
    indices: tuple[Optional[torch.Tensor], ...]
    stream: str = DEFAULT_STREAM
    #: High counter words ``hbase + sum_d hstrides[d] * idx_d(p_d)`` (words 2-3 of each element's Philox
    #: counter); ``hstrides`` empty: 0 (docs/spec.md 14.8).
    hbase: int = 0
    hstrides: tuple[int, ...] = ()


def _as_range(index: torch.Tensor) -> Optional[int]:
    """The start if ``index`` is ``start, start+1, ...`` (or empty: 0), else None."""
    n = int(index.numel())
    if n == 0:
        return 0
    start = int(index[0])
    if n == 1 or bool((index[1:] - index[:-1] == 1).all()):
        return start
    return None


def _from_region(region: Region, row_offset: int = 0) -> Layout:
    starts, indices = [], []
    for dim, index in enumerate(region.indices):
        if dim == 0 and row_offset:
            index = index + row_offset
        start = _as_range(index)
        starts.append(0 if start is None else start)
        indices.append(index if start is None else None)
    shape = list(region.shape)
    if shape and row_offset:
        shape[0] += row_offset
    return Layout(row_major_strides(shape), tuple(starts), tuple(indices))


def _check_numel(shape: Sequence[int], what: str) -> None:
    if math.prod(shape) > MAX_NUMEL:
        raise ValueError(f"{what} {tuple(shape)} has more than 2**62 elements: the stream cannot address it")


def _slices_only(shape: tuple[int, ...], region: Sequence[Any]) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(starts, sizes) when every entry is a slice with step 1 (pure Python: traceable by torch.compile)."""
    if not isinstance(region, (tuple, list)) or len(region) != len(shape):
        return None
    starts, sizes = [], []
    for entry, n in zip(region, shape):
        if not isinstance(entry, slice) or entry.step not in (None, 1):
            return None
        start, stop, _ = entry.indices(n)
        starts.append(start)
        sizes.append(max(0, stop - start))
    return tuple(starts), tuple(sizes)


def layout_for(local_shape: Sequence[int], global_shape: Optional[Sequence[int]], region: Any) -> Layout:
    """Layout of a plain local tensor that holds ``full[region]`` of a ``global_shape`` tensor.

    ``global_shape=None`` means the local shape; ``region=None`` the whole
    global tensor. The region's shape must equal the local shape.
    """
    local_shape = tuple(int(n) for n in local_shape)
    shape = local_shape if global_shape is None else normalize_shape(tuple(global_shape))
    if region is None:
        if shape != local_shape:
            raise ValueError(
                f"dropout: the input has shape {local_shape} but global_shape is {shape}; pass the region "
                "of the global tensor that the input holds"
            )
        _check_numel(shape, "global_shape")
        return Layout(row_major_strides(shape), (0,) * len(shape), (None,) * len(shape))
    fast = _slices_only(shape, region)
    if fast is not None:
        starts, sizes = fast
        if sizes != local_shape:
            raise ValueError(
                f"dropout: the region of global shape {shape} has shape {sizes}, but the input has shape {local_shape}"
            )
        _check_numel(shape, "global_shape")
        return Layout(row_major_strides(shape), starts, (None,) * len(shape))
    normalized = make_region(shape, region)
    if normalized.region_shape != local_shape:
        raise ValueError(
            f"dropout: the region of global shape {shape} has shape {normalized.region_shape}, but the input has "
            f"shape {local_shape}"
        )
    return _from_region(normalized)


def dtensor_layout(tensor: Any, row_offset: int = 0, stream: Optional[str] = None) -> Layout:
    """Layout of a DTensor's local tensor, from its mesh coordinate and placements (no communication).

    ``row_offset`` shifts dimension 0 (the batch) by that many rows: the keyed
    convention, where the DTensor's row ``r`` is global sample ``row_offset + r``.
    ``stream="v2"``: the keyed forward's extent-free names (docs/spec.md 14.8) of the global tensor whose
    dimension 0 is the batch, in place of its row-major indices.
    """
    from keyinit._sharding.placements import dtensor_region

    spec = tensor._spec
    mesh = spec.mesh
    coordinate = mesh.get_coordinate()
    try:
        coordinate = None if coordinate is None else tuple(int(c) for c in coordinate)
        region = dtensor_region(
            tuple(tensor.shape), tuple(mesh.shape), coordinate, tuple(spec.placements), spec.shard_order,
            strided_shard_as_shard_order=spec.use_strided_shard_as_shard_order,
        )
    except ValueError as exc:
        raise ValueError(f"dropout of a DTensor with placements {tuple(spec.placements)}: {exc}") from None
    local = tensor._local_tensor
    if coordinate is not None and tuple(local.shape) != region.region_shape:
        raise ValueError(
            f"dropout: the DTensor's local tensor has shape {tuple(local.shape)} but its placements "
            f"{tuple(spec.placements)} select a region of shape {region.region_shape} of {tuple(tensor.shape)}"
        )
    if coordinate is None:
        shape = tuple(local.shape)
        return Layout(row_major_strides(shape), (0,) * len(shape), (None,) * len(shape))
    if stream == V2:
        if not tensor.dim():
            raise ValueError("a 0-d activation has no batch dimension (dim 0) to key its rows by")
        laid = _from_region(region, row_offset)  # (dimension 0's starts or index shifted by row_offset)
        check_samples(row_offset, int(tensor.shape[0]), "a keyed DTensor activation")
        lo, hi = names_strides(tuple(tensor.shape[1:]), what="a keyed DTensor activation")
        return Layout(lo, laid.starts, laid.indices, hi)
    if tensor.dim() and row_offset:
        _check_numel((row_offset + tensor.shape[0], *tensor.shape[1:]), "the keyed activation's global shape")
    return _from_region(region, row_offset)


def rows_layout(local_shape: Sequence[int], row_offset: int, stream: str = DEFAULT_STREAM) -> Layout:
    """Layout of a plain activation whose row ``r`` (dimension 0) is global sample ``row_offset + r``: its
    row-major index in ``(row_offset + rows, ...)`` (docs/spec.md 14.4), or, for a key of stream v2, its
    extent-free name (section 14.8)."""
    shape, row_offset = tuple(map(int, local_shape)), int(row_offset)
    if torch.compiler.is_compiling():  # dynamo traces through the function, not the memo
        return _rows_layout.__wrapped__(shape, row_offset, stream == V2)
    return _rows_layout(shape, row_offset, stream == V2)


@functools.lru_cache(maxsize=1024)
def _rows_layout(shape: tuple[int, ...], row_offset: int, extent_free: bool = False) -> Layout:
    """:func:`rows_layout` (memoized: a keyed forward lays out the same few shapes at every step; a Layout
    is a tuple of tuples)."""
    if not shape:
        raise ValueError("a 0-d activation has no batch dimension (dim 0) to key its rows by")
    starts = (row_offset,) + (0,) * (len(shape) - 1)
    if extent_free:
        check_samples(row_offset, shape[0])
        lo, hi = names_strides(shape[1:])
        return Layout(lo, starts, (None,) * len(shape), hi)
    _check_numel((row_offset + shape[0], *shape[1:]), "the keyed activation's global shape")
    return Layout(row_major_strides(shape), starts, (None,) * len(shape))


@functools.lru_cache(maxsize=256)
def constants(p: float) -> tuple[int, float, float]:
    """``(threshold, scale32, scale64)`` for drop probability ``p``.

    ``threshold = round_ties_even((1 - p) * 2**32)`` (keyinit.random.bernoulli's
    for ``p_keep = 1 - p``), ``scale64 = 1 / (1 - p)`` in binary64 and
    ``scale32`` that rounded to binary32 (both 0 when ``p == 1``).
    """
    threshold = Bernoulli.create(1.0 - p).threshold
    if p >= 1.0:
        return threshold, 0.0, 0.0
    scale64 = 1.0 / (1.0 - p)
    scale32 = struct.unpack("<f", struct.pack("<f", scale64))[0]
    return threshold, scale32, scale64


@functools.lru_cache(maxsize=1024)
def _ranges_template(shape: tuple[int, ...], p: float, gstrides: tuple[int, ...], starts: tuple[int, ...],
                     stream: str) -> Geometry:
    """The :class:`Geometry` of a layout of ranges only (no index vector) with key words 0: everything but
    the key, memoized (a pure function of ints, ``p`` and the stream name, and a keyed forward plans the
    same few shapes at every step; :func:`make_geometry` copies it under each call's key)."""
    shape = tuple(map(int, shape))
    if not (len(gstrides) == len(starts) == len(shape)):
        raise ValueError(
            f"keyinit::dropout: {len(shape)}-D input but {len(gstrides)} strides, {len(starts)} starts and "
            f"{len(shape)} index entries"
        )
    threshold, scale32, scale64 = constants(p)
    gstrides, starts = tuple(map(int, gstrides)), tuple(map(int, starts))
    base, dims = coalesce(zip(shape, row_major_strides(shape), gstrides, (g * s for g, s in zip(gstrides, starts)),
                              (None,) * len(shape)))
    return Geometry(k0=0, k1=0, threshold=threshold, scale32=scale32, scale64=scale64, base=base,
                    sizes=tuple(d[0] for d in dims), gstrides=tuple(d[2] for d in dims),
                    indices=(None,) * len(dims), stream=stream)


@functools.lru_cache(maxsize=1024)
def rows_template(shape: tuple[int, ...], row_offset: int, p: float, stream: str) -> Geometry:
    """The key-less :class:`Geometry` (key words 0) of a contiguous activation of ``shape`` laid out by
    :func:`rows_layout` (row ``r`` is global sample ``row_offset + r``), memoized; :func:`with_key` gives a
    call's geometry."""
    layout = rows_layout(shape, row_offset, stream)
    if layout.hstrides:
        return make_geometry(tuple(map(int, shape)), 0, 0, p, layout.gstrides, layout.starts, layout.indices,
                             stream, layout.hstrides)
    return _ranges_template(tuple(map(int, shape)), p, layout.gstrides, layout.starts, stream)


def with_key(template: Geometry, k0: int, k1: int) -> Geometry:
    """``template`` (a :class:`Geometry`) with the key words ``(k0, k1)``."""
    return Geometry(int(k0), int(k1), template.threshold, template.scale32, template.scale64, template.base,
                    template.sizes, template.gstrides, template.indices, template.stream, template.hbase,
                    template.hstrides)


def ranges_geometry(shape: Sequence[int], k0: int, k1: int, p: float, gstrides: Sequence[int],
                    starts: Sequence[int], stream: str = DEFAULT_STREAM) -> Geometry:
    """:func:`make_geometry` of a layout with no index vector (the caller knows it has none)."""
    return with_key(_ranges_template(tuple(shape), p, tuple(gstrides), tuple(starts), stream), k0, k1)


def make_geometry(shape: Sequence[int], k0: int, k1: int, p: float, gstrides: Sequence[int], starts: Sequence[int],
         indices: Sequence[Optional[torch.Tensor]], stream: str = DEFAULT_STREAM,
         hstrides: Sequence[int] = ()) -> Geometry:
    """The coalesced :class:`Geometry` of a contiguous tensor of ``shape`` placed by the op's layout arguments,
    for the key ``(k0, k1)`` of stream version ``stream`` (``hstrides``: the high counter words' strides,
    docs/spec.md 14.8; empty for none)."""
    if not hstrides and len(indices) == len(shape) and all(index is None for index in indices):
        # ranges only: the coalesced dims depend on the ints alone
        return ranges_geometry(shape, k0, k1, p, gstrides, starts, stream)
    shape = tuple(map(int, shape))
    if not (len(gstrides) == len(starts) == len(indices) == len(shape)) or hstrides and len(hstrides) != len(shape):
        raise ValueError(
            f"keyinit::dropout: {len(shape)}-D input but {len(gstrides)} strides, {len(starts)} starts, "
            f"{len(indices)} index entries and {len(hstrides)} high strides"
        )
    threshold, scale32, scale64 = constants(p)

    def dims_in() -> Iterator[tuple[int, int, int, int, Optional[torch.Tensor], int, int]]:
        # the output is contiguous: row-major strides of the shape
        for n, ostride, gs, st, idx, hs in zip(shape, row_major_strides(shape), gstrides, starts, indices,
                                               hstrides or (0,) * len(shape)):
            gs, st, hs = int(gs), int(st), int(hs)
            if idx is not None:
                if idx.dim() != 1 or int(idx.numel()) != n or idx.dtype != torch.int64:
                    raise ValueError(f"keyinit::dropout: an index entry must be a 1-D int64 tensor of {n} elements")
                idx = idx.to("cpu")
            yield n, ostride, gs, gs * st, idx, hs, hs * st

    base, hbase, dims = coalesce_high(dims_in())
    return Geometry(
        k0=int(k0), k1=int(k1), threshold=threshold, scale32=scale32, scale64=scale64, base=base,
        sizes=tuple(d[0] for d in dims), gstrides=tuple(d[2] for d in dims), indices=tuple(d[3] for d in dims),
        stream=stream, hbase=hbase, hstrides=tuple(d[4] for d in dims) if hstrides else (),
    )

