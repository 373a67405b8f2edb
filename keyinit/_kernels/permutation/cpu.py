"""The compiled CPU permutation kernel (``permutation_kernels.c``): built on first use, called through ctypes.

Built, verified, loaded and self-tested (:mod:`keyinit._kernels._permutation_selftest`)
by the one loader of the C kernels (:class:`keyinit._kernels._library.CompiledLibrary`).
:func:`run` returns ``False`` when the kernel is unavailable; the caller then
uses the reference (:mod:`keyinit._draw.reference_permutation`), same values.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from keyinit._kernels import _permutation_selftest
from keyinit._kernels._library import CompiledLibrary

__all__ = ["KERNEL", "SOURCE", "LIBRARY", "library", "run"]

#: Positions per thread below which fewer threads are used (starting a thread would dominate).
MIN_PER_THREAD = 1 << 16


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.keyinit_permute.restype = ctypes.c_int
    lib.keyinit_permute.argtypes = [
        ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
    ]
    return lib


def _selftest_run(lib: ctypes.CDLL) -> list[str]:
    return _permutation_selftest.run(lambda *args, **kwargs: run(*args, lib=lib, **kwargs))


#: The permutation kernel library (``permutation_kernels.c``), loaded through the one loader.
KERNEL = CompiledLibrary("the compiled CPU permutation kernel", "permutation_kernels.c", declare, _selftest_run)
SOURCE = KERNEL.source

#: Build (or reuse from the cache) and load a variant of the library.
build_library = KERNEL.build

#: The library built for this machine (loaded on first use, after its golden self-test).
LIBRARY = KERNEL.checked

#: The same library without the self-test (tests only).
UNCHECKED = KERNEL.unchecked

library = KERNEL.library
available = KERNEL.available
failure_reason = KERNEL.failure_reason
unchecked_library = UNCHECKED.get


def run(kp: tuple[int, int], n: int, inverse: bool, out: torch.Tensor, *, positions: Optional[torch.Tensor] = None,
        start: int = 0, step: int = 1, threads: Optional[int] = None, lib: Optional[ctypes.CDLL] = None) -> bool:
    """``out[k] = perm(p_k)`` (or the inverse) with ``p_k = positions[k]`` or ``start + step*k``.

    ``out`` is a contiguous CPU int64 tensor; ``positions`` (if given) a contiguous CPU int64
    tensor of the same length, every value in ``[0, n)``; ``n >= 2``. ``False``: nothing written.
    """
    if lib is None:
        lib = library()
    if lib is None:
        LIBRARY.warn_once()
        return False
    count = out.numel()
    if threads is None:
        threads = max(1, min(torch.get_num_threads(), count // MIN_PER_THREAD))
    lib.keyinit_permute(kp[0], kp[1], n, int(inverse), None if positions is None else positions.data_ptr(),
                        start, step, count, out.data_ptr(), threads)
    return True
