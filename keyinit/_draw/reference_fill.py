"""The reference filler: stream v1 in plain torch ops, chunked.

It is the executable spec and the yardstick for every fast kernel: readable
rather than fast (a few million elements per second on one CPU core). Work
is done in chunks of ``CHUNK_ELEMENTS`` region elements, so the workspace is
bounded whatever the size of the region.
"""

from __future__ import annotations

import torch

from keyinit._bits.philox import stream_words
from keyinit.distributions import Distribution
from keyinit.keys import Key
from keyinit.regions import Region

__all__ = ["fill", "scatter_strided", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 1 << 16


def fill(out: torch.Tensor, dist: Distribution, key: Key, region: Region, chunk_elements: int = CHUNK_ELEMENTS) -> None:
    """Write ``dist``'s values for ``region`` of the stream of ``key`` into ``out``.

    ``out`` has the region's shape, any strides and any device. Element
    ``(p_0, ..., p_{d-1})`` of ``out`` receives global flat index
    ``sum_k region.indices[k][p_k] * stride_k``.
    """
    flat_out = out.view(-1) if out.is_contiguous() else None
    for start, stop in region.chunks(chunk_elements):
        element = region.flat_indices(start, stop).to(out.device)
        values = dist.transform(stream_words(key.words, element, dist.words_per_element)).to(out.dtype)
        if flat_out is not None:
            flat_out[start:stop] = values
        else:
            scatter_strided(out, start, stop, values)


def scatter_strided(out: torch.Tensor, start: int, stop: int, values: torch.Tensor) -> None:
    """Write region elements ``start .. stop - 1`` (row-major) of a non-contiguous ``out``.

    The elements are addressed through a 1-D view of ``out``'s storage that
    spans exactly the memory ``out`` covers.
    """
    position = torch.arange(start, stop, dtype=torch.int64, device=out.device)
    offset = torch.zeros_like(position)
    for size, stride in zip(reversed(out.shape), reversed(out.stride())):
        offset += (position % size) * stride
        position = position // size
    span = 1 + sum((size - 1) * stride for size, stride in zip(out.shape, out.stride()))
    out.as_strided((span,), (1,), out.storage_offset())[offset] = values
