"""The reference of keyed stochastic rounding over a region: plain torch integer ops, chunked.

Element ``(p_0, ..., p_{d-1})`` of the input, which holds ``full[region]`` of a tensor of the region's
global shape, is rounded with stream word ``word(K, i)`` of its global flat index ``i``
(``docs/spec.md`` section 17; the word that ``uniform`` and ``bits`` use for element ``i``), so a region
or shard rounds exactly as the whole tensor does. It runs on any device.
"""

from __future__ import annotations

import torch

from keyinit._bits.sround import TARGETS, round_bits, to_dtype
from keyinit._draw.reference_fill import CHUNK_ELEMENTS, scatter_strided
from keyinit.keys import Key
from keyinit.regions import Region

__all__ = ["round_into"]


def round_into(out: torch.Tensor, x: torch.Tensor, key: Key, region: Region,
               chunk_elements: int = CHUNK_ELEMENTS) -> None:
    """Write ``x`` (float32 or float64, shaped like ``region``) rounded stochastically to ``out.dtype``
    into ``out`` (same shape, any strides and device)."""
    target = TARGETS[out.dtype]
    source = x.detach().reshape(-1)  # region order (row-major over the region)
    words_of = key.impl.words
    flat_out = out.view(-1) if out.is_contiguous() else None
    for start, stop in region.chunks(chunk_elements):
        element = region.flat_indices(start, stop).to(out.device)
        (words,) = words_of(key.words, element, 1)
        values = to_dtype(round_bits(source[start:stop].to(out.device), words, target), out.dtype)
        if flat_out is not None:
            flat_out[start:stop] = values
        else:
            scatter_strided(out, start, stop, values)
