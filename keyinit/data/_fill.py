"""The CPU fill kernel as keyed data calls it: key folds in C, fills of contiguous tensors and of rows.

:func:`fold` is ``keyinit.fold_in`` of an int or a str; with the CPU kernel library (:func:`fold_with`,
:func:`fold_words`: :mod:`keyinit._kernels.fill.folds`, named here too) the Philox of a stream v1
derivation runs in C. :func:`fill_folded` writes a draw of a keyed op under ``fold_in(fold_in(key, call), draw)`` with the two folds and the fill in one C call
(``keyinit_fill_folded``); :func:`fill` writes a draw at a :class:`Geometry` (all of a contiguous
tensor, or rows at listed flat indices: keyed collate). Without the library (``KEYINIT_DISABLE_KERNELS``,
no compiler) every function gives the same values through the reference.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any, Optional

import torch

from keyinit._draw.geometry import coalesce
from keyinit._kernels.common.ids import DIST_IDS, DTYPE_IDS
from keyinit._kernels.fill.cpu import MIN_PARALLEL_ELEMENTS
from keyinit._kernels.fill.folds import fold_with, fold_words, fold_words_v1, kernel_library
from keyinit.keys import Key, fold_in
from keyinit.regions import make_region

__all__ = ["fold", "fold_str", "fold_with", "fold_words", "fold_words_v1", "folded", "draw_key", "kernel_library",
           "Geometry", "fill", "fill_folded"]

#: ``fold_in`` of an int and of a str (the names the fast path's callers use; one derivation: keys.fold_in).
fold = fold_in
fold_str = fold_in


@functools.lru_cache(maxsize=1024)
def folded(parent: Key, data: int) -> Key:
    """``fold_in(parent, data)``, remembered: the domain and epoch keys every sample of an epoch shares."""
    return fold_in(parent, data)


@functools.lru_cache(maxsize=4096)
def draw_key(parent: Key, call: int, draw: int) -> Key:
    """``fold(fold(parent, call), draw)``, remembered: collate keys repeat for every batch of an epoch."""
    return fold(fold(parent, call), draw)


class Geometry:
    """Where a fill's elements lie in the stream: all of a contiguous ``out`` from flat index 0
    (``rows`` None), or row ``b`` of an ``(B, R)`` ``out`` from flat index ``rows[b] * row_stride``;
    the kernel's arguments are built once and reused for every draw of that geometry."""

    __slots__ = ("rows", "row_stride", "numel", "args")

    def __init__(self, shape: tuple[int, ...], rows: Optional[torch.Tensor] = None, row_stride: int = 0) -> None:
        self.rows, self.row_stride, self.numel = rows, row_stride, math.prod(shape)
        if rows is None:
            base, dims = 0, [[self.numel, 1, 1, None]]
        else:
            base, dims = coalesce([(shape[0], shape[1], row_stride, 0, rows), (shape[1], 1, 1, 0, None)])
        nd = len(dims)
        self.args = (nd, base, (ctypes.c_int64 * nd)(*(d[0] for d in dims)),
                     (ctypes.c_int64 * nd)(*(d[1] for d in dims)), (ctypes.c_int64 * nd)(*(d[2] for d in dims)),
                     (ctypes.c_void_p * nd)(*(None if d[3] is None else d[3].data_ptr() for d in dims)))


@functools.lru_cache(maxsize=64)
def _params(dist: Any) -> tuple:
    from keyinit._kernels.fill.cpu import kernel_params as params

    f, i = params(dist)
    return (ctypes.c_double * 6)(*f), (ctypes.c_int64 * 4)(*i)


@functools.lru_cache(maxsize=256)
def _kernel_args(dist: Any, dtype: torch.dtype) -> Optional[tuple]:
    """``(dist id, dtype id, fparams, iparams)`` of the fill kernel, or None where it has no such pair."""
    dist_id, dtype_id = DIST_IDS.get(type(dist)), DTYPE_IDS.get(dtype)
    if dist_id is None or dtype_id is None:
        return None
    return (dist_id, dtype_id) + _params(dist)


def fill_folded(lib: Any, out: torch.Tensor, dist: Any, key: Key, call: int, draw: int) -> None:
    """Write ``dist``'s values into ``out`` (a contiguous CPU tensor, written whole from flat index 0) under
    ``fold_in(fold_in(key, call), draw)``: the two folds and the fill in one C call (``lib``; v1 keys),
    else :func:`fill` under the key folded in Python. The version counter is the caller's to bump."""
    numel = out.numel()
    args = _kernel_args(dist, out.dtype) if lib is not None and key.stream == "v1" else None
    if args is None:
        fill(lib, out, dist, fold(fold(key, call), draw))
    elif numel:
        dist_id, dtype_id, fparams, iparams = args
        threads = 1 if numel < MIN_PARALLEL_ELEMENTS else max(1, torch.get_num_threads())
        rc = lib.keyinit_fill_folded(dist_id, dtype_id, key.k0, key.k1, call, draw, fparams, iparams, numel,
                                     out.data_ptr(), threads)
        if rc != 0:  # pragma: no cover - the arguments are those keyinit_fill accepts
            raise RuntimeError(f"keyinit_fill_folded failed with code {rc}")


def fill(lib: Any, out: torch.Tensor, dist: Any, key: Key, geometry: Optional[Geometry] = None) -> None:
    """Write ``dist``'s values into ``out`` (a new contiguous CPU tensor) at ``geometry`` (default: all
    of ``out`` from flat index 0) of ``key``'s stream.

    The values of ``keyinit._draw.dispatch.fill`` with the matching region (the kernel called directly,
    without building the region and its checks); the reference where ``lib`` is None.
    """
    numel = out.numel()
    if numel == 0:
        return
    args = _kernel_args(dist, out.dtype) if lib is not None and key.stream == "v1" else None
    if args is None:
        from keyinit._draw import dispatch as _dispatch

        if geometry is None or geometry.rows is None:
            region = make_region(tuple(out.shape), None)
        else:
            region = make_region(((1 << 62) // geometry.row_stride, geometry.row_stride),
                                 (geometry.rows, range(out.shape[1])))
        _dispatch.fill(out, dist, key, region)
        return
    if geometry is None:
        geometry = Geometry(tuple(out.shape))
    dist_id, dtype_id, fparams, iparams = args
    threads = 1 if numel < MIN_PARALLEL_ELEMENTS else max(1, torch.get_num_threads())
    rc = lib.keyinit_fill(dist_id, dtype_id, key.k0, key.k1, fparams, iparams, *geometry.args, out.data_ptr(),
                          threads)
    if rc != 0:  # pragma: no cover - the arguments are the ones _dispatch.fill would pass
        raise RuntimeError(f"keyinit_fill failed with code {rc}")
