"""The compiled CPU dropout kernel (``dropout_kernels.c``): build on first use, call through ctypes.

The library is built, verified, loaded and self-tested by the one loader of
the C kernels (:class:`keyinit._kernels.common.library.CompiledLibrary`), like the
init kernel, from ``dropout_kernels.c`` and the headers it includes.

:func:`run` takes a prepared :class:`~keyinit._draw.dropout_geometry.Geometry` and
writes ``out`` (contiguous, like ``x``); it returns ``False`` when the kernel
is unavailable (no compiler, or a library that fails its golden self-test,
:mod:`keyinit._kernels.dropout.selftest`), and the caller then uses the reference.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Optional

import torch

from keyinit._kernels.dropout import selftest as _dropout_selftest
from keyinit._kernels.common import ids as _ids
from keyinit._kernels.common.library import I64P, MAX_DIMS, CompiledLibrary

__all__ = ["KERNEL", "SOURCE", "DTYPE_IDS", "library", "available", "failure_reason", "run", "MIN_PARALLEL_ELEMENTS"]

#: dtype ids (the one table, :mod:`keyinit._kernels.common.ids`) of the dtypes dropout takes.
DTYPE_IDS = {dtype: _ids.DTYPE_IDS[dtype] for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)}
#: Below this many elements one thread does the work (thread start-up would dominate).
MIN_PARALLEL_ELEMENTS = 1 << 17



def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the ctypes signatures of the dropout library's functions."""
    lib.keyinit_dropout.restype = ctypes.c_int
    lib.keyinit_dropout.argtypes = [
        ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_float, ctypes.c_double,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, I64P, I64P,
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p,
    ]
    lib.keyinit_dropout_philox_stream.restype = None
    lib.keyinit_dropout_philox_stream.argtypes = [
        ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p,
    ]
    lib.keyinit_dropout_f16_roundtrip.restype = None
    lib.keyinit_dropout_f16_roundtrip.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _selftest_run(lib: ctypes.CDLL) -> list[str]:
    return _dropout_selftest.run(lambda x, out, geometry, threads: run(x, out, geometry, threads=threads, lib=lib))


#: The dropout kernel library (``dropout_kernels.c``), loaded through the one loader.
KERNEL = CompiledLibrary("the compiled CPU dropout kernel", "dropout/dropout_kernels.c", declare, _selftest_run)
#: Looked up at each call, so a test can patch it; ``LIBRARY``, ``UNCHECKED``, ``SOURCE``, ... are the loader's.
library = KERNEL.checked.get
__getattr__ = KERNEL.module_attribute


@functools.lru_cache(maxsize=1024)
def _int64_array(values: tuple[int, ...]) -> ctypes.Array:
    """``values`` as a C ``int64_t[]`` (memoized: the kernel only reads it, and a keyed forward passes the
    same few sizes and strides at every step)."""
    return (ctypes.c_int64 * len(values))(*values)


@functools.lru_cache(maxsize=1024)
def _arrays(sizes: tuple[int, ...], gstrides: tuple[int, ...]) -> tuple[int, ctypes.Array, ctypes.Array, ctypes.Array]:
    """``(ndim, sizes, gstrides, null index pointers)`` as the kernel takes them (memoized, read-only to it)."""
    return len(sizes), _int64_array(sizes), _int64_array(gstrides), _null_pointers(len(sizes))


@functools.lru_cache(maxsize=None)
def _null_pointers(n: int) -> ctypes.Array:
    """``n`` null index pointers (no dimension indexed), read-only to the kernel."""
    return (ctypes.c_void_p * n)()


def run(x: torch.Tensor, out: torch.Tensor, geometry, threads: Optional[int] = None,
        lib: Optional[ctypes.CDLL] = None) -> bool:
    """``out = dropout(x)`` for contiguous CPU tensors ``x`` and ``out`` of ``geometry``'s shape.

    ``geometry`` is a coalesced :class:`keyinit._draw.dropout_geometry.Geometry`. ``threads``
    defaults to ``torch.get_num_threads()`` (one thread for small tensors);
    ``lib`` to the library built for this machine. ``False``: nothing written.
    """
    dtype_id = DTYPE_IDS.get(x.dtype)
    if dtype_id is None or not x.is_cpu or len(geometry.sizes) > MAX_DIMS:
        return False
    if lib is None:
        lib = library()
        if lib is None:
            KERNEL.checked.warn_once(stacklevel=4)
            return False
    nd, sizes, gstrides, pointers = _arrays(geometry.sizes, geometry.gstrides)
    keep_alive: Sequence = ()
    for index in geometry.indices:
        if index is not None:  # index vectors: their pointers (the arrays' null pointers otherwise)
            keep_alive = [None if i is None else i.contiguous() for i in geometry.indices]
            pointers = (ctypes.c_void_p * nd)(*(None if i is None else i.data_ptr() for i in keep_alive))
            break
    if threads is None:
        threads = 1 if x.numel() < MIN_PARALLEL_ELEMENTS else max(1, torch.get_num_threads())
    hstrides = geometry.hstrides
    rc = lib.keyinit_dropout(
        dtype_id, geometry.k0, geometry.k1, geometry.threshold, geometry.scale32, geometry.scale64,
        x.data_ptr(), out.data_ptr(), nd, geometry.base, sizes, gstrides, pointers, threads,
        geometry.hbase, _int64_array(hstrides) if hstrides else None,
    )
    if rc != 0:  # pragma: no cover - arguments are validated by Geometry
        raise RuntimeError(f"keyinit_dropout failed with code {rc}")
    del keep_alive
    _increment_version((out,))  # (torch.autograd.graph.increment_version's own call)
    return True


_increment_version = torch._C._increment_version
