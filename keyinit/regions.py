"""Regions: which global elements of a tensor a sampler produces.

A region has one entry per dimension of the global shape: a ``slice`` (any
step), a sequence of ints, or a 1-D integer tensor. Entries index like
``numpy.ix_``: the result is the outer product, so ``full[region]`` has shape
``(len(entry_0), len(entry_1), ...)``. Negative ints count from the end, as in
Python; anything outside ``[-n, n)`` is an error.

:class:`Region` is the normalized form: one int64 CPU index vector per dimension
plus the global row-major strides. Element ``(p_0, ..., p_{d-1})`` of the region
is global flat index ``sum_k index[k][p_k] * stride[k]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Union

import attrs
import torch

__all__ = ["Region", "RegionEntry", "normalize_shape", "make_region", "MAX_NUMEL"]

RegionEntry = Union[slice, Sequence[int], torch.Tensor]

#: Largest global numel a stream can address: every element's words lie below 2**64.
MAX_NUMEL = 1 << 62


def normalize_shape(shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, or a ``ValueError`` naming the fault."""
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"shape must be a tuple of ints, got {type(shape).__name__}")
    dims = []
    for dim in shape:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"shape must be a tuple of ints, got {tuple(shape)!r}")
        if dim < 0:
            raise ValueError(f"shape must have non-negative sizes, got {tuple(shape)!r}")
        dims.append(dim)
    if math.prod(dims) > MAX_NUMEL:
        raise ValueError(f"shape {tuple(dims)} has more than 2**62 elements")
    return tuple(dims)


def _row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= size
    return tuple(reversed(strides))


def _entry_indices(entry: Any, size: int, dim: int) -> torch.Tensor:
    if isinstance(entry, slice):
        if entry.step == 0:
            raise ValueError(f"region entry {dim} is a slice with step 0; expected a non-zero step")
        start, stop, step = entry.indices(size)
        # not torch.arange(start, stop, step): it rejects empty ranges such as slice(1, 0)
        count = len(range(start, stop, step))
        return start + step * torch.arange(count, dtype=torch.int64)
    if isinstance(entry, torch.Tensor):
        if entry.dim() != 1 or entry.dtype.is_floating_point or entry.dtype == torch.bool or entry.is_complex():
            raise TypeError(
                f"region entry {dim} must be a 1-D integer tensor, got a {entry.dim()}-D {entry.dtype} tensor"
            )
        indices = entry.detach().to("cpu", torch.int64)
    elif isinstance(entry, Sequence) and not isinstance(entry, (str, bytes)):
        if any(isinstance(i, bool) or not isinstance(i, int) for i in entry):
            raise TypeError(f"region entry {dim} must hold ints, got {list(entry)!r}")
        bad = next((i for i in entry if not -size <= i < size), None)
        if bad is not None:  # checked before torch.tensor, which overflows past int64
            raise IndexError(f"region entry {dim} has index {bad}, out of bounds for size {size}")
        indices = torch.tensor(list(entry), dtype=torch.int64).reshape(-1)
    else:
        raise TypeError(
            f"region entry {dim} must be a slice, a sequence of ints or a 1-D integer tensor, "
            f"got {type(entry).__name__}"
        )
    if indices.numel():
        low, high = int(indices.min()), int(indices.max())
        if low < -size or high >= size:
            bad = low if low < -size else high
            raise IndexError(f"region entry {dim} has index {bad}, out of bounds for size {size}")
        indices = torch.where(indices < 0, indices + size, indices)
    return indices


@attrs.frozen(eq=False)
class Region:
    """A normalized region of a tensor of global shape ``shape``.

    ``indices[k]`` holds the global indices taken along dimension ``k``.
    """

    shape: tuple[int, ...]
    indices: tuple[torch.Tensor, ...]

    @property
    def region_shape(self) -> tuple[int, ...]:
        """The shape of ``full[region]``."""
        return tuple(int(index.numel()) for index in self.indices)

    @property
    def numel(self) -> int:
        return math.prod(self.region_shape)

    @property
    def strides(self) -> tuple[int, ...]:
        """Row-major strides of the global shape."""
        return _row_major_strides(self.shape)

    def flat_indices(self, start: int, stop: int) -> torch.Tensor:
        """Global flat indices of region elements ``start .. stop - 1`` (row-major in the region)."""
        position = torch.arange(start, stop, dtype=torch.int64)
        flat = torch.zeros_like(position)
        for size, index, stride in zip(
            reversed(self.region_shape), reversed(self.indices), reversed(self.strides)
        ):
            flat += index[position % size] * stride
            position = position // size
        return flat

    def chunks(self, chunk_size: int) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` ranges that cover the region in row-major order."""
        total = self.numel
        for start in range(0, total, chunk_size):
            yield start, min(start + chunk_size, total)


def make_region(shape: tuple[int, ...], region: Union[None, Region, Sequence[RegionEntry]]) -> Region:
    """Normalize ``region`` (``None`` means the whole tensor) against ``shape``."""
    if isinstance(region, Region):
        if region.shape != shape:
            raise ValueError(f"region was made for shape {region.shape}, not {shape}")
        return region
    if region is None:
        return Region(shape, tuple(torch.arange(size, dtype=torch.int64) for size in shape))
    if not isinstance(region, (tuple, list)):
        raise TypeError(f"region must be a tuple with one entry per dimension, got {type(region).__name__}")
    if len(region) != len(shape):
        raise ValueError(
            f"region has {len(region)} entries but the shape {shape} has {len(shape)} dimensions"
        )
    return Region(shape, tuple(_entry_indices(e, s, d) for d, (e, s) in enumerate(zip(region, shape))))
