"""Chooses the implementation of every kernel family: the one seam between keyinit and its kernels.

Three families, each with one call here:

- :func:`fill`: a distribution's values for a region (``keyinit.random``, the
  initializers, replayed init code);
- :func:`dropout`: keyed dropout of a tensor laid out by a
  :class:`~keyinit._draw.dropout_geometry.Geometry` (the ``keyinit::dropout`` op and its
  eager form, ``keyinit.nn._op``);
- :func:`permute`: the keyed permutation at some positions (``keyinit.data``).

The implementations belong to the key's stream version: the registered
:class:`keyinit._bits.streams.Stream` that ``key.stream`` names (``geometry.stream``
for dropout) has each family as a :class:`Kernels`, a reference that runs on
any device and kernels by device type. Every kernel must produce exactly the
reference's bits, and the tests hold them to it. Stream v1's:

- CPU tensors: the compiled C kernels (``keyinit._kernels._cpu``,
  ``_dropout_cpu``, ``_permutation_cpu``), built on first use; if one cannot be
  built or fails its golden self-test, one ``RuntimeWarning`` and the reference;
- CUDA tensors: the Triton kernels (``keyinit._kernels.triton_kernel``,
  ``triton_dropout``, ``triton_permutation``) when the optional ``triton``
  package is installed;
- anything else, or ``KEYINIT_DISABLE_KERNELS=1``: the reference.

Implementations are named by module and function (:class:`KernelRef`) and
imported on first use, so importing keyinit builds, loads and registers nothing.
A new stream version brings its own families; nothing here changes.

The fast fill kernels write ``out``'s memory directly. A view with torch's
negative bit (``x.conj().imag``) reads that memory negated, so it is filled
through a plain temporary and ``copy_``, which applies the view's semantics. A
meta ``out`` (a draw under ``torch.device("meta")``) has no memory: nothing is
computed.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from keyinit._bits.streams import KernelRef, Kernels, get_stream
from keyinit.distributions import Distribution
from keyinit.keys import Key
from keyinit.regions import Region

__all__ = ["KernelRef", "Kernels", "fill", "dropout", "permute"]


def fill(out: torch.Tensor, dist: Distribution, key: Key, region: Region) -> None:
    """Fill ``out`` (shaped like ``region``) with ``dist``'s values from ``key``'s stream."""
    stream = get_stream(key.stream)
    if out.numel() == 0 or out.device.type == "meta":
        return
    if out.is_neg() or out.is_conj():
        plain = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        fill(plain, dist, key, region)
        out.copy_(plain)
        return
    stream.fill.run(out.device.type, out, dist, key, region)


def dropout(x: torch.Tensor, geometry: Any) -> torch.Tensor:
    """Keyed dropout of ``x`` laid out by ``geometry`` (a :class:`keyinit._draw.dropout_geometry.Geometry`, which
    carries the key's words and stream version): a new contiguous tensor."""
    stream = get_stream(geometry.stream)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    stream.dropout.run(x.device.type, x, out, geometry)
    return out


def permute(key: Key, n: int, inverse: bool, out: torch.Tensor, *, positions: Optional[torch.Tensor] = None,
            start: int = 0, step: int = 1) -> torch.Tensor:
    """``out[k] = perm(p_k)`` (``inverse``: ``perm^-1(p_k)``) of the keyed permutation of ``range(n)``
    (``2 <= n <= 2**62``), with ``p_k = positions[k]`` (an int64 tensor of ``out``'s shape, on its device)
    or ``start + step * k``; returns ``out``."""
    from keyinit._draw.reference_permutation import permutation_key

    stream = get_stream(key.stream)
    if out.numel():
        kp = permutation_key(key, n).words  # derived in the key's own stream
        stream.permutation.run(out.device.type, kp, n, inverse, out, positions=positions, start=start, step=step)
    return out
