"""The ids of distributions and output dtypes that keyinit's kernels share: ONE table, for C and Triton.

A kernel receives a distribution and a dtype as small integers. They are
defined here and nowhere else:

- the C kernels get them as preprocessor definitions, which
  :mod:`keyinit._kernels.common.build` adds to every compile (:func:`c_defines`:
  ``KI_DIST_<NAME>``, ``KI_DTYPE_<NAME>``, ``KI_DIST_COUNT``, ``KI_DTYPE_COUNT``;
  ``ids.h`` refuses to compile without them), so a C source holds no ids of its own;
- the Triton kernels and the Python side of every kernel import this module
  (:data:`DIST_IDS`, :data:`DTYPE_IDS`, and the ``tl.constexpr`` globals that
  ``fill.triton_impl`` and ``dropout.triton`` derive from :data:`DIST` and :data:`DTYPE`).

Ids are positions in :data:`DISTRIBUTIONS` and :data:`DTYPES`, so they are
``0 .. count - 1``. They are an internal calling convention, never stored
and never part of the stream: renumbering changes no value (the compiled
libraries' cache key covers the definitions).
"""

from __future__ import annotations

import torch

from keyinit.distributions import Bernoulli, Bits, Distribution, Normal, Randint, TruncatedNormal, Uniform

__all__ = ["DISTRIBUTIONS", "DTYPES", "DIST", "DTYPE", "DIST_IDS", "DTYPE_IDS", "c_defines"]

#: The distributions the kernels compute, in id order (exact types: a subclass is not accepted).
DISTRIBUTIONS: tuple[type[Distribution], ...] = (Bits, Uniform, Normal, TruncatedNormal, Bernoulli, Randint)

#: The output dtypes the kernels store, in id order.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.bool,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
)

#: Distribution id by name (``Distribution.name``): ``DIST["normal"] == 2``.
DIST: dict[str, int] = {cls.name: i for i, cls in enumerate(DISTRIBUTIONS)}

#: dtype id by name (the torch dtype without ``torch.``): ``DTYPE["bfloat16"] == 2``.
DTYPE: dict[str, int] = {str(dtype).removeprefix("torch."): i for i, dtype in enumerate(DTYPES)}

#: Distribution id by class (exact type).
DIST_IDS: dict[type[Distribution], int] = {cls: i for i, cls in enumerate(DISTRIBUTIONS)}

#: dtype id by torch dtype.
DTYPE_IDS: dict[torch.dtype, int] = {dtype: i for i, dtype in enumerate(DTYPES)}


def c_defines() -> tuple[str, ...]:
    """The ``-D`` flags that give the C kernels this table (``KI_DIST_NORMAL=2``, ``KI_DTYPE_BFLOAT16=2``, ...)."""
    flags = [f"-DKI_DIST_{name.upper()}={i}" for name, i in DIST.items()]
    flags += [f"-DKI_DTYPE_{name.upper()}={i}" for name, i in DTYPE.items()]
    flags += [f"-DKI_DIST_COUNT={len(DIST)}", f"-DKI_DTYPE_COUNT={len(DTYPE)}"]
    return tuple(flags)
