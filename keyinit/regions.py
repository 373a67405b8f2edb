"""Regions: which global elements of a tensor a sampler produces.

A region has one entry per dimension of the global shape: a ``slice`` (any
step), a ``range``, a sequence of ints, or a 1-D integer tensor. Entries index
like ``numpy.ix_``: the result is the outer product, so ``full[region]`` has
shape ``(len(entry_0), len(entry_1), ...)``. Negative ints count from the end,
as in Python; anything outside ``[-n, n)`` is an error.

:class:`Region` is the normalized form. Each dimension holds either

- a ``range`` (``start``, ``step``, ``len``) of global indices in ``[0, n)``: a
  slice stays three integers and no index vector is ever built for it; or
- an int64 CPU tensor of global indices in ``[0, n)``: only for explicit lists
  and tensors that are not an arithmetic progression (those become ranges).

Element ``(p_0, ..., p_{d-1})`` of the region is global flat index
``sum_k entry[k][p_k] * stride[k]`` with the global row-major strides. So the
memory a region costs is its per-dimension index lists at most, never one
entry per element, and a full draw of any shape needs no index memory at all.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any, Union

import attrs
import torch

__all__ = ["Region", "RegionEntry", "IndexEntry", "make_region", "MAX_NUMEL"]

RegionEntry = Union[slice, range, Sequence[int], torch.Tensor]
#: A normalized entry: a ``range`` of in-bounds indices, or an int64 CPU index tensor.
IndexEntry = Union[range, torch.Tensor]

#: Largest global numel a stream can address: every element's words lie below 2**64.
MAX_NUMEL = 1 << 62

_CPU = torch.device("cpu")


def _integer(value: Any) -> "int | None":
    """An int, or an integer scalar as torch takes in a shape (a numpy int, a 0-d integer tensor),
    as a Python int; ``None`` for anything else, bools included."""
    if isinstance(value, int):
        return None if isinstance(value, bool) else value
    if isinstance(value, (float, str, bytes)) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


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
        dim = _integer(dim)
        if dim is None:
            raise TypeError(f"shape must be a tuple of ints, got {tuple(shape)!r}")
        if dim < 0:
            raise ValueError(f"shape must have non-negative sizes, got {tuple(shape)!r}")
        dims.append(dim)
    if math.prod(dims) > MAX_NUMEL:
        raise ValueError(f"shape {tuple(dims)} has more than 2**62 elements")
    return tuple(dims)


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major (C-order) element strides of ``shape``: element ``(i_0, ..., i_{d-1})`` has flat
    index ``sum_k i_k * strides[k]``. A dimension of size 0 counts as 1 (no element exists then, and
    the strides stay positive)."""
    strides = []
    running = 1
    for size in reversed(tuple(shape)):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _canonical_range(start: int, step: int, count: int) -> range:
    """``range`` of ``count`` indices ``start, start + step, ...``; step 1 when ``count <= 1``."""
    if count == 0:
        return range(0)
    if count == 1:
        return range(start, start + 1)
    return range(start, start + step * count, step)


def _out_of_bounds(dim: int, bad: int, size: int) -> IndexError:
    return IndexError(f"region entry {dim} has index {bad}, out of bounds for size {size}")


def _range_entry(entry: range, size: int, dim: int) -> IndexEntry:
    count = len(entry)
    if count == 0:
        return range(0)
    first, last = entry[0], entry[-1]
    low, high = min(first, last), max(first, last)
    if low < -size or high >= size:
        raise _out_of_bounds(dim, low if low < -size else high, size)
    if high < 0:  # all negative: shifting by size keeps it a progression
        first += size
    elif low < 0:  # mixed signs wrap to two pieces: an explicit index vector
        indices = entry.start + entry.step * torch.arange(count, dtype=torch.int64, device=_CPU)
        return torch.where(indices < 0, indices + size, indices)
    return _canonical_range(first, entry.step, count)


def _as_progression(indices: torch.Tensor) -> IndexEntry:
    """``indices`` (int64, CPU, in bounds) as a ``range`` if it is an arithmetic progression."""
    count = int(indices.numel())
    if count == 0:
        return range(0)
    first = int(indices[0])
    if count == 1:
        return _canonical_range(first, 1, 1)
    step = int(indices[1]) - first
    if step != 0 and bool((indices[1:] - indices[:-1] == step).all()):
        return _canonical_range(first, step, count)
    return indices


def _tensor_entry(entry: torch.Tensor, size: int, dim: int) -> IndexEntry:
    if entry.dim() != 1 or entry.dtype.is_floating_point or entry.dtype == torch.bool or entry.is_complex():
        raise TypeError(
            f"region entry {dim} must be a 1-D integer tensor, got a {entry.dim()}-D {entry.dtype} tensor"
        )
    if entry.device.type == "meta":
        if entry.numel() == 0:
            return range(0)
        raise ValueError(
            f"region entry {dim} is a meta tensor: its indices have no values; pass the indices on the CPU"
        )
    if entry.numel() == 0:
        return range(0)
    source = entry.detach()
    if source.is_neg():
        source = source.resolve_neg()
    # A private copy: the caller may change their tensor later, and the kernels trust these bounds.
    if source.dtype == getattr(torch, "uint64", None):
        as_signed = source.to(_CPU).contiguous().view(torch.int64)  # values >= 2**63 read as negative
        if bool((as_signed < 0).any()):
            raise _out_of_bounds(dim, int(as_signed[as_signed < 0][0]) + 2**64, size)
        indices = as_signed.clone()
    else:  # every other integer dtype converts to int64 exactly
        indices = source.to(device=_CPU, dtype=torch.int64, copy=True).contiguous()
    low, high = int(indices.min()), int(indices.max())
    if low < -size or high >= size:
        raise _out_of_bounds(dim, low if low < -size else high, size)
    if low < 0:
        indices = torch.where(indices < 0, indices + size, indices)
    return _as_progression(indices)


def _sequence_entry(entry: Sequence[Any], size: int, dim: int) -> IndexEntry:
    values = list(entry)
    if any(isinstance(i, bool) or not isinstance(i, int) for i in values):
        raise TypeError(f"region entry {dim} must hold ints, got {values!r}")
    bad = next((i for i in values if not -size <= i < size), None)
    if bad is not None:  # checked before torch.tensor, which overflows past int64
        raise _out_of_bounds(dim, bad, size)
    indices = torch.tensor([i + size if i < 0 else i for i in values], dtype=torch.int64, device=_CPU)
    return _as_progression(indices.reshape(-1))


def _normalize_entry(entry: Any, size: int, dim: int) -> IndexEntry:
    """One region entry as a :data:`IndexEntry` of in-bounds global indices along a dim of ``size``."""
    if isinstance(entry, slice):
        if entry.step == 0:
            raise ValueError(f"region entry {dim} is a slice with step 0; expected a non-zero step")
        start, stop, step = entry.indices(size)
        return _canonical_range(start, step, len(range(start, stop, step)))
    if isinstance(entry, range):
        return _range_entry(entry, size, dim)
    if isinstance(entry, torch.Tensor):
        return _tensor_entry(entry, size, dim)
    if isinstance(entry, Sequence) and not isinstance(entry, (str, bytes)):
        return _sequence_entry(entry, size, dim)
    raise TypeError(
        f"region entry {dim} must be a slice, a sequence of ints or a 1-D integer tensor, "
        f"got {type(entry).__name__}"
    )


def _check_entries(shape: tuple[int, ...], entries: Any) -> tuple[IndexEntry, ...]:
    if not isinstance(entries, (tuple, list)):
        raise TypeError(f"region must be a tuple with one entry per dimension, got {type(entries).__name__}")
    if len(entries) != len(shape):
        raise ValueError(f"region has {len(entries)} entries but the shape {shape} has {len(shape)} dimensions")
    return tuple(_normalize_entry(e, s, d) for d, (e, s) in enumerate(zip(entries, shape)))


def _entry_tensor(entry: IndexEntry) -> torch.Tensor:
    if isinstance(entry, range):
        return entry.start + entry.step * torch.arange(len(entry), dtype=torch.int64, device=_CPU)
    return entry.clone()  # callers get their own copy; the region keeps the one the kernels read


@attrs.frozen(eq=False)
class Region:
    """A normalized region of a tensor of global shape ``shape``.

    ``entries[k]`` holds the global indices taken along dimension ``k``: a
    ``range`` (lazy, three integers) or an int64 CPU tensor, all in
    ``[0, shape[k])``. ``Region(shape, entries)`` accepts any entries that
    :func:`make_region` accepts (slices, ranges, int sequences, 1-D integer
    tensors of any integer dtype and device but meta) and validates them: an
    index out of bounds is an ``IndexError``, a float, bool or meta index tensor
    a ``TypeError``/``ValueError``. Index tensors are copied, so changing the
    caller's tensor afterwards cannot change the region.
    """

    shape: tuple[int, ...] = attrs.field(converter=normalize_shape)
    entries: tuple[IndexEntry, ...] = attrs.field(alias="indices")
    _cache: dict = attrs.field(factory=dict, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "entries", _check_entries(self.shape, self.entries))

    @property
    def indices(self) -> tuple[torch.Tensor, ...]:
        """One int64 CPU index tensor per dimension (built on first use and cached).

        The kernels never need these: prefer :attr:`entries`, which keeps
        slices as ranges.
        """
        cached = self._cache.get("indices")
        if cached is None:
            cached = tuple(_entry_tensor(entry) for entry in self.entries)
            self._cache["indices"] = cached
        return cached

    @property
    def region_shape(self) -> tuple[int, ...]:
        """The shape of ``full[region]``."""
        return tuple(len(entry) for entry in self.entries)

    @property
    def numel(self) -> int:
        return math.prod(self.region_shape)

    @property
    def strides(self) -> tuple[int, ...]:
        """Row-major strides of the global shape."""
        return row_major_strides(self.shape)

    def is_range(self, dim: int) -> bool:
        """True when dimension ``dim`` is a lazy ``range`` (a slice), not an index tensor."""
        return isinstance(self.entries[dim], range)

    def flat_indices(self, start: int, stop: int) -> torch.Tensor:
        """Global flat indices of region elements ``start .. stop - 1`` (row-major in the region)."""
        position = torch.arange(start, stop, dtype=torch.int64, device=_CPU)
        flat = torch.zeros_like(position)
        for size, entry, stride in zip(
            reversed(self.region_shape), reversed(self.entries), reversed(self.strides)
        ):
            p = position % size
            if isinstance(entry, range):
                flat += (entry.start + entry.step * p) * stride
            else:
                flat += entry[p] * stride
            position = position // size
        return flat

    def chunks(self, chunk_size: int) -> Iterator[tuple[int, int]]:
        """``(start, stop)`` ranges that cover the region in row-major order."""
        total = self.numel
        for start in range(0, total, chunk_size):
            yield start, min(start + chunk_size, total)


def make_region(shape: tuple[int, ...], region: Union[None, Region, Sequence[RegionEntry]]) -> Region:
    """Normalize ``region`` (``None`` means the whole tensor) against ``shape``.

    Slices and ranges stay ranges (no index vector is built); an explicit list or
    tensor that is an arithmetic progression becomes a range too.
    """
    if isinstance(region, Region):
        if region.shape != tuple(shape):
            raise ValueError(f"region was made for shape {region.shape}, not {shape}")
        return region
    if region is None:
        return Region(shape, tuple(range(size) for size in shape))
    if not isinstance(region, (tuple, list)):
        raise TypeError(f"region must be a tuple with one entry per dimension, got {type(region).__name__}")
    return Region(shape, tuple(region))
