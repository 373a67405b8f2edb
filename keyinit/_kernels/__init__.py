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
:mod:`keyinit._draw.dispatch` chooses among them and the reference.

Set ``KEYINIT_DISABLE_KERNELS=1`` to force the reference implementation.
"""

from __future__ import annotations

import os

__all__ = ["kernels_disabled"]


def kernels_disabled() -> bool:
    """True when ``KEYINIT_DISABLE_KERNELS`` is set to a true value (1, true, yes, on)."""
    return os.environ.get("KEYINIT_DISABLE_KERNELS", "").strip().lower() in ("1", "true", "yes", "on")
