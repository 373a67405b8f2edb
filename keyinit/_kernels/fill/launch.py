"""The Triton fill's launch constants, which the host side (:mod:`keyinit._kernels.fill.triton`, importable
without triton) and the jitted kernel (:mod:`keyinit._kernels.fill.triton_impl`) both need."""

from __future__ import annotations

__all__ = ["MAX_DIMS", "NB", "BLOCK", "LOOP", "MIN_PROGRAMS"]

#: Dimensions a Triton launch describes after size-1 dims are dropped and slice dims merged; more: the reference.
MAX_DIMS = 4
#: Elements per Triton program: Philox blocks per RUN program, elements per GENERAL program.
NB = 256
BLOCK = 1024
#: Most tiles of NB Philox blocks a RUN program computes in turn (its row decoded, with 64-bit divisions, once
#: for all of them): on an H100, 16 per program took a 16384 x 16384 uniform fill from 0.90 ms to 0.58 ms.
LOOP = 16
#: Programs a RUN launch keeps at least, where it has that many tiles (several per multiprocessor).
MIN_PROGRAMS = 2048
