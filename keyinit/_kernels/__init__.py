"""Fast implementations of stream v1, each bit-identical to :mod:`keyinit._reference`.

- :mod:`keyinit._kernels._cpu`: a C kernel compiled on first use (``_build``,
  which refuses builds that change floating-point semantics) and called through
  ctypes, for CPU tensors; it proves itself against golden digests when it
  loads (``_selftest``);
- :mod:`keyinit._kernels.triton_kernel`: a Triton kernel for CUDA tensors,
  used when the optional ``triton`` package is installed.

Both take their geometry from :mod:`keyinit._kernels._plan`: slices stay
``(start, step, count)``, so a contiguous run of a region shares Philox blocks.

Set ``KEYINIT_DISABLE_KERNELS=1`` to force the reference implementation.
"""

from __future__ import annotations

import os

__all__ = ["kernels_disabled"]


def kernels_disabled() -> bool:
    """True when ``KEYINIT_DISABLE_KERNELS`` is set to a true value (1, true, yes, on)."""
    return os.environ.get("KEYINIT_DISABLE_KERNELS", "").strip().lower() in ("1", "true", "yes", "on")
