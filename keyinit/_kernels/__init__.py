"""Fast implementations of stream v1, each bit-identical to :mod:`keyinit._reference`.

- :mod:`keyinit._kernels._cpu`: a C kernel compiled on first use (``_build``)
  and called through ctypes, for CPU tensors;
- :mod:`keyinit._kernels.triton_kernel`: a Triton kernel for CUDA tensors,
  used when the optional ``triton`` package is installed.

Set ``KEYINIT_DISABLE_KERNELS=1`` to force the reference implementation.
"""

from __future__ import annotations

import os

__all__ = ["kernels_disabled"]


def kernels_disabled() -> bool:
    """True when ``KEYINIT_DISABLE_KERNELS`` is set to a true value (1, true, yes, on)."""
    return os.environ.get("KEYINIT_DISABLE_KERNELS", "").strip().lower() in ("1", "true", "yes", "on")
