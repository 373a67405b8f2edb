"""Geometry of a fill, shared by the compiled kernels: what each dimension adds to the indices.

A fill writes region element ``(p_0, ..., p_{d-1})`` to ``out`` at element offset
``sum_k p_k * out_stride[k]``; its global flat index is
``base + sum_k idx_k(p_k) * global_stride[k]``, where ``idx_k(p)`` is ``index[k][p]``
for an index-list dim and ``p`` for a slice dim (whose start is folded into
``base`` and whose step into ``global_stride``). No per-element index memory
exists for a slice.

It also holds the Triton fill's launch constants, which the host side
(``triton_kernel``, importable without triton) and the jitted kernel
(``_triton_impl``) both need.
"""

from __future__ import annotations

from typing import Optional

import torch

from keyinit.regions import Region

__all__ = ["Dim", "geometry", "MAX_DIMS", "NB", "BLOCK"]

#: Dimensions a Triton launch describes after size-1 dims are dropped and slice dims merged; more: the reference.
MAX_DIMS = 4
#: Elements per Triton program: Philox blocks per RUN program, elements per GENERAL program.
NB = 256
BLOCK = 1024

#: ``[size, out_stride, global_stride, index]``; ``index`` is an int64 CPU tensor or ``None`` (a slice).
Dim = list


def geometry(out: torch.Tensor, region: Region) -> tuple[int, list[Dim]]:
    """``(base, dims)``, outermost dim first, for filling ``out`` (shaped like ``region``).

    Size-1 dimensions are folded into ``base``, and neighbouring slice dims that
    walk both the global tensor and ``out`` as one progression are merged, so a
    full draw of any shape into a contiguous ``out`` is a single dim: one run of
    consecutive global indices. At least one dim is returned.
    """
    if tuple(out.shape) != region.region_shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but the region has shape {region.region_shape}")
    base = 0
    dims: list[Dim] = []
    for entry, size, gstride, n, ostride in zip(region.entries, region.shape, region.strides, out.shape,
                                                out.stride()):
        index: Optional[torch.Tensor] = None
        if isinstance(entry, range):
            first, step = entry.start, entry.step
        else:
            if n and not 0 <= int(entry.min()) <= int(entry.max()) < size:
                # Region validated its own copy: only code that wrote into region.entries gets here.
                raise ValueError(f"a Region index tensor holds indices outside [0, {size}): it was modified "
                                 "after the Region was built")
            first, step, index = int(entry[0]) if n else 0, 1, entry
        if n == 1:
            base += first * gstride
            continue
        if index is None:
            base += first * gstride
            dim = [n, ostride, step * gstride, None]
        else:
            dim = [n, ostride, gstride, index]
        outer = dims[-1] if dims else None
        if (outer is not None and outer[3] is None and dim[3] is None
                and outer[2] == n * dim[2] and outer[1] == n * dim[1]):
            outer[0] *= n
            outer[1], outer[2] = dim[1], dim[2]
        else:
            dims.append(dim)
    if not dims:
        dims.append([1, 1, 0, None])
    return base, dims
