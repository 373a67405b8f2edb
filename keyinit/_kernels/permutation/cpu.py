"""The compiled CPU permutation kernel (``permutation_kernels.c``): built on first use, called through ctypes.

Built, verified, loaded and self-tested (:mod:`keyinit._kernels.permutation.selftest`)
by the one loader of the C kernels (:class:`keyinit._kernels.common.library.CompiledLibrary`).
:func:`run` returns ``False`` when the kernel is unavailable; the caller then
uses the reference (:mod:`keyinit._draw.reference_permutation`), same values.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from keyinit._kernels.permutation import selftest as _permutation_selftest
from keyinit._kernels.common.library import CompiledLibrary

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
KERNEL = CompiledLibrary("the compiled CPU permutation kernel", "permutation/permutation_kernels.c", declare, _selftest_run)
#: Looked up at each call, so a test can patch it; ``LIBRARY``, ``UNCHECKED``, ``SOURCE``, ... are the loader's.
library = KERNEL.library
__getattr__ = KERNEL.module_attribute


def run(kp: tuple[int, int], n: int, inverse: bool, out: torch.Tensor, *, positions: Optional[torch.Tensor] = None,
        start: int = 0, step: int = 1, threads: Optional[int] = None, lib: Optional[ctypes.CDLL] = None) -> bool:
    """``out[k] = perm(p_k)`` (or the inverse) with ``p_k = positions[k]`` or ``start + step*k``.

    ``out`` is a contiguous CPU int64 tensor; ``positions`` (if given) a contiguous CPU int64
    tensor of the same length, every value in ``[0, n)``; ``n >= 2``. ``False``: nothing written.
    """
    lib = lib if lib is not None else KERNEL.usable(library)
    if lib is None:
        return False
    count = out.numel()
    if threads is None:
        threads = max(1, min(torch.get_num_threads(), count // MIN_PER_THREAD))
    lib.keyinit_permute(kp[0], kp[1], n, int(inverse), None if positions is None else positions.data_ptr(),
                        start, step, count, out.data_ptr(), threads)
    return True
