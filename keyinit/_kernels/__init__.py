"""Fast implementations of stream v1, each bit-identical to :mod:`keyinit._draw.reference_fill`.

- C kernels for CPU tensors, called through ctypes: the init kernel
  (``keyinit_kernels.c``, :mod:`~keyinit._kernels._cpu`), keyed dropout
  (``dropout_kernels.c``, :mod:`~keyinit._kernels._dropout_cpu`) and the keyed
  permutation (``permutation_kernels.c``, :mod:`~keyinit._kernels._permutation_cpu`).
  They share one Philox (``philox.h``), one set of float conversions
  (``convert.h``) and one thread pool (``parallel.h``); the init kernel's binary32
  transforms (log, the normal quantile) are ``fp32math.h``. All are loaded by
  one loader (:class:`~keyinit._kernels._library.CompiledLibrary`): compiled on
  first use by ``_build`` (which refuses builds that change floating-point
  semantics and verifies cached builds), then proved against golden digests
  (``_selftest``, ``_dropout_selftest``, ``_permutation_selftest``);
- Triton kernels for CUDA tensors (``triton_kernel``, ``triton_dropout``,
  ``triton_permutation``), used when the optional ``triton`` package is installed.

The fill kernels take their geometry from :mod:`keyinit._draw.geometry`: slices
stay ``(start, step, count)``, so a contiguous run of a region shares Philox blocks.
:func:`register` puts them in :mod:`keyinit._draw.dispatch`'s table (importing keyinit calls it once:
nothing is imported, built or loaded until a kernel is first called), and the dispatcher chooses
among them and the reference. Set ``KEYINIT_DISABLE_KERNELS=1`` to force the reference implementation.
"""

from __future__ import annotations

from keyinit._draw.dispatch import KernelRef, register_kernel

__all__ = ["register"]

#: Stream v1's kernels: (family, device type, module, function).
_V1 = (
    ("fill", "cpu", "keyinit._kernels._cpu", "fill"),
    ("fill", "cuda", "keyinit._kernels.triton_kernel", "fill"),
    ("dropout", "cpu", "keyinit._kernels._dropout_cpu", "run"),
    ("dropout", "cuda", "keyinit._kernels.triton_dropout", "run"),
    ("permutation", "cpu", "keyinit._kernels._permutation_cpu", "run"),
    ("permutation", "cuda", "keyinit._kernels.triton_permutation", "run"),
)


def register() -> None:
    """Register stream v1's kernels in :data:`keyinit._draw.dispatch.KERNELS` (again: no change). Each is
    named by module and imported on its first call."""
    for family, device, module, name in _V1:
        register_kernel("v1", family, device, KernelRef(module, name))
