"""Chooses the implementation that fills a region: the one seam for fast kernels.

Every implementation must produce exactly the bits of
:func:`keyinit._reference.fill`; the tests hold them to it.

- CPU tensors: the compiled C kernel (:mod:`keyinit._kernels._cpu`), built on
  first use; if it cannot be built, one ``RuntimeWarning`` and the reference.
- CUDA tensors: the Triton kernel (:mod:`keyinit._kernels.triton_kernel`) when
  the optional ``triton`` package is installed.
- Anything else, or ``KEYINIT_DISABLE_KERNELS=1``: the reference.

The fast kernels write ``out``'s memory directly. A view with torch's negative
bit (``x.conj().imag``) reads that memory negated, so it is filled through a
plain temporary and ``copy_``, which applies the view's semantics. A meta
``out`` (a draw under ``torch.device("meta")``) has no memory: nothing is computed.
"""

from __future__ import annotations

import torch

from keyinit import _reference
from keyinit._kernels import kernels_disabled
from keyinit.distributions import Distribution
from keyinit.keys import Key
from keyinit.regions import Region

__all__ = ["fill"]


def fill(out: torch.Tensor, dist: Distribution, key: Key, region: Region) -> None:
    """Fill ``out`` (shaped like ``region``) with ``dist``'s values from ``key``'s stream."""
    if key.stream != "v1":  # pragma: no cover - guarded by Key's validator
        raise ValueError(f"no implementation for stream {key.stream!r}")
    if out.numel() == 0 or out.device.type == "meta":
        return
    if out.is_neg() or out.is_conj():
        plain = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        fill(plain, dist, key, region)
        out.copy_(plain)
        return
    if not kernels_disabled():
        device = out.device.type
        if device == "cpu":
            from keyinit._kernels import _cpu

            if _cpu.fill(out, dist, key, region):
                return
        elif device == "cuda":
            from keyinit._kernels import triton_kernel

            if triton_kernel.fill(out, dist, key, region):
                return
    _reference.fill(out, dist, key, region)
