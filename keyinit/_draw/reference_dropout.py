"""Reference keyed dropout in plain torch ops: the executable form of ``docs/spec.md`` section 14.

Readable rather than fast; it runs where no kernel does (no C compiler, no
Triton on CUDA, other devices, ``KEYINIT_DISABLE_KERNELS=1``), and the tests
compare every kernel with :func:`keyinit.random.bernoulli`'s mask put through
:func:`apply_mask`.
"""

from __future__ import annotations

from typing import Any

import torch

from keyinit._bits.philox import stream_words
from keyinit._draw.dropout_geometry import Geometry

__all__ = ["apply_mask", "dropout", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 1 << 16


def apply_mask(x: torch.Tensor, keep: torch.Tensor, scale32: float, scale64: float) -> torch.Tensor:
    """``keep ? x * scale : +0`` with the spec's arithmetic (``keep`` broadcasts against ``x``).

    float64: the binary64 product with ``scale64``; float32: the binary32 product
    with ``scale32``; bfloat16/float16: the binary32 product ``f32(x) * scale32``
    rounded to the dtype (nearest even).
    """
    if x.dtype == torch.float64:
        product = x * torch.tensor(scale64, dtype=torch.float64, device=x.device)
    else:
        product = x.float() * torch.tensor(scale32, dtype=torch.float32, device=x.device)
        product = product.to(x.dtype)
    return torch.where(keep, product, torch.zeros((), dtype=x.dtype, device=x.device))


def _flat_indices(geometry: Geometry, start: int, stop: int, device: torch.device) -> tuple[torch.Tensor, Any]:
    """Global flat indices and high counter words (0 without ``hstrides``) of elements ``start .. stop-1``
    (row-major over ``geometry.sizes``)."""
    position = torch.arange(start, stop, dtype=torch.int64, device=device)
    flat = torch.full_like(position, geometry.base)
    hstrides = geometry.hstrides or (0,) * len(geometry.sizes)
    high: Any = torch.full_like(position, geometry.hbase) if geometry.hstrides else 0
    for size, gstride, hstride, index in zip(reversed(geometry.sizes), reversed(geometry.gstrides),
                                             reversed(hstrides), reversed(geometry.indices)):
        local = position % size
        at = index.to(device)[local] if index is not None else local
        flat += gstride * at
        if hstride:
            high = high + hstride * at
        position = position // size
    return flat, high


def dropout(x: torch.Tensor, out: torch.Tensor, geometry: Geometry, chunk_elements: int = CHUNK_ELEMENTS) -> None:
    """``out = dropout(x)`` for contiguous ``x`` and ``out`` shaped like ``geometry``, in chunks."""
    flat_x, flat_out = x.reshape(-1), out.view(-1)
    key = (geometry.k0, geometry.k1)
    for start in range(0, flat_x.numel(), chunk_elements):
        stop = min(start + chunk_elements, flat_x.numel())
        flat, high = _flat_indices(geometry, start, stop, x.device)
        words = stream_words(key, flat, 1, high)[0]
        keep = words < geometry.threshold
        flat_out[start:stop] = apply_mask(flat_x[start:stop], keep, geometry.scale32, geometry.scale64)
