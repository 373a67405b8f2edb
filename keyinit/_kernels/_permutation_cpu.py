"""The compiled CPU permutation kernel (``permutation_kernels.c``): built on first use, called through ctypes.

Built by :mod:`keyinit._kernels._build` like the other kernels (the header's
digest goes into the cache key through a ``-D`` flag, as for the dropout
kernel). :func:`run` returns ``False`` when the kernel is unavailable; the
caller then uses the reference (:mod:`keyinit.data._feistel`), same values.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional

import torch

from keyinit._kernels import _build
from keyinit._kernels._dropout_cpu import header_flag
from keyinit._kernels._lazy import LazyLibrary

__all__ = ["SOURCE", "LIBRARY", "library", "run"]

SOURCE = Path(__file__).with_name("permutation_kernels.c")
#: Positions per thread below which fewer threads are used (starting a thread would dominate).
MIN_PER_THREAD = 1 << 16


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.keyinit_permute.restype = ctypes.c_int
    lib.keyinit_permute.argtypes = [
        ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
    ]
    return lib


def build_library(native: bool = True, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (or reuse from the cache) and load a variant of the library."""
    return declare(_build.load(native, (header_flag(), *extra_flags), source=SOURCE))


#: The library built for this machine (loaded on first use).
LIBRARY = LazyLibrary("the compiled CPU permutation kernel", build_library)


def library() -> Optional[ctypes.CDLL]:
    return LIBRARY.get()


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
