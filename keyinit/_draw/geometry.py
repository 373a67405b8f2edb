"""Geometry shared by every kernel family (fills, dropout): what each dimension adds to the indices.

A kernel writes element ``(p_0, ..., p_{d-1})`` of a region or an activation to ``out`` at element offset
``sum_k p_k * out_stride[k]``; its global flat index is
``base + sum_k idx_k(p_k) * global_stride[k]``, where ``idx_k(p)`` is ``index[k][p]``
for an index-list dim and ``p`` for a slice dim (whose start is folded into
``base`` and whose step into ``global_stride``). No per-element index memory
exists for a slice.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Optional

import torch

from keyinit.regions import Region

__all__ = ["Dim", "coalesce", "coalesce_high", "geometry"]

#: ``[size, out_stride, global_stride, index]``; ``index`` is an int64 CPU tensor or ``None`` (a slice).
Dim = list


def coalesce(dims_in: Iterable[tuple[int, int, int, int, Optional[torch.Tensor]]]) -> tuple[int, list[Dim]]:
    """``(base, dims)`` from ``(size, out_stride, global_stride, offset, index)`` per dimension, outermost first.

    A dimension adds ``offset + p * global_stride`` to the global flat index of its position ``p``
    (a progression: ``index`` is None) or ``index[p] * global_stride`` (an index list; ``offset``
    unused). Every offset is folded into ``base``, and so is each size-1 dimension; neighbouring
    progressions that walk both the global tensor and the output as one progression are merged.
    The kernels of every family (fills, dropout) take this one shape of geometry. At least one
    dim is returned. (:func:`coalesce_high` with no high counter words.)
    """
    base, _, dims = coalesce_high((n, o, g, off, idx, 0, 0) for n, o, g, off, idx in dims_in)
    return base, [d[:4] for d in dims]


def coalesce_high(dims_in: Iterable[tuple[int, int, int, int, Optional[torch.Tensor], int, int]]
                  ) -> tuple[int, int, list[list]]:
    """:func:`coalesce` of dimensions that also add to an element's high counter words (``docs/spec.md``
    14.8): from ``(size, out_stride, global_stride, offset, index, high_stride, high_offset)`` per
    dimension, ``(base, high_base, dims)`` with dims ``[size, out_stride, global_stride, index,
    high_stride]``; neighbours merge only where the high words walk them as one progression too."""
    base = high = 0
    dims: list[list] = []
    for n, ostride, gstride, offset, index, hstride, hoffset in dims_in:
        if n == 1:
            if index is not None:
                base, high = base + int(index[0]) * gstride, high + int(index[0]) * hstride
            else:
                base, high = base + offset, high + hoffset
            continue
        if index is None:
            base, high = base + offset, high + hoffset
        outer = dims[-1] if dims else None
        if (outer is not None and outer[3] is None and index is None and outer[2] == n * gstride
                and outer[1] == n * ostride and outer[4] == n * hstride):
            outer[0] *= n
            outer[1], outer[2], outer[4] = ostride, gstride, hstride
        else:
            dims.append([n, ostride, gstride, index, hstride])
    if not dims:
        dims.append([1, 1, 0, None, 0])
    return base, high, dims


def geometry(out: torch.Tensor, region: Region) -> tuple[int, list[Dim]]:
    """``(base, dims)``, outermost dim first, for filling ``out`` (shaped like ``region``).

    See :func:`coalesce`: a full draw of any shape into a contiguous ``out`` is a single dim, one
    run of consecutive global indices.
    """
    if tuple(out.shape) != region.region_shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but the region has shape {region.region_shape}")

    def dims_in() -> Iterator[tuple[int, int, int, int, Optional[torch.Tensor]]]:
        for entry, size, gstride, n, ostride in zip(region.entries, region.shape, region.strides, out.shape,
                                                    out.stride()):
            if isinstance(entry, range):
                yield n, ostride, entry.step * gstride, entry.start * gstride, None
                continue
            if n and not 0 <= int(entry.min()) <= int(entry.max()) < size:
                # Region validated its own copy: only code that wrote into region.entries gets here.
                raise ValueError(f"a Region index tensor holds indices outside [0, {size}): it was modified "
                                 "after the Region was built")
            yield n, ostride, gstride, 0, entry

    return coalesce(dims_in())
