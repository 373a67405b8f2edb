"""The Triton fill's launch constants, which the host side (:mod:`keyinit._kernels.fill.triton`, importable
without triton) and the jitted kernel (:mod:`keyinit._kernels.fill.triton_impl`) both need."""

from __future__ import annotations

__all__ = ["MAX_DIMS", "NB", "BLOCK"]

#: Dimensions a Triton launch describes after size-1 dims are dropped and slice dims merged; more: the reference.
MAX_DIMS = 4
#: Elements per Triton program: Philox blocks per RUN program, elements per GENERAL program.
NB = 256
BLOCK = 1024
