"""Extent-free element names of keyed forwards (stream v2, ``docs/spec.md`` section 14.8).

Stream v1 names an element of a keyed activation by its row-major index in the tensor of samples
``(start + count, *sample_shape)``: ``sample * prod(sample_shape) + within``. Both terms depend on the
extents of the sample's dimensions, so a sample padded to 6 tokens in one batch and to 4 in another gets
other masks on the same real tokens. Stream v2 names it by its sample and its coordinates alone, put in
the four 32-bit words of the Philox counter, with no extent anywhere:

- the sample's dimensions of extent 1 are not coordinates (a dimension that is 1 in one layout and
  absent in another names nothing);
- of the others, innermost first: ``c_1`` (the innermost), ``c_2``, ``c_3``; a missing one is 0, so
  leading coordinates of 0 name nothing either (``(L, D)`` and ``(1, L, D)`` give the same names);
- word ``j`` (``0 <= j < w``, ``w`` the words per element) of the element is lane ``t % 4`` of
  ``Philox4x32-10((t // 4, c_2, c_3, sample), K)`` with ``t = c_1 * w + j``;
- with ``k > 3`` coordinates, ``c_3 .. c_k`` share counter word 2: it is
  ``sum_i c_(3+i) * 2**(i * b)`` with ``b = 32 // (k - 2)`` bits each (``c_(3+i) < 2**b``).

In the affine form the kernels take (:mod:`keyinit._draw.dropout_geometry`): a low index
``lo = c_2 * 2**34 / w + c_1`` (its stream words are counter words 0-1, as in section 4) and high
counter words ``hi = sample * 2**32 + c_3``. Limits: ``c_1 < 2**32``, ``c_2 < 2**29``, ``c_3 < 2**32``,
``sample < 2**31`` (with more than three coordinates, ``2**b`` for ``c_3 .. c_k``); beyond them a clear
error.

The random ops of a keyed forward draw by these names while :func:`naming` is open: :func:`fill` is stream
v2's fill reference (:func:`fill_named` under :func:`naming`, else the element stream of section 4, as v1),
and :func:`named_geometry` gives the fill kernels the same draw as a geometry with high counter words
(``keyinit._kernels.fill``), which must give :func:`fill_named`'s bits.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch

from keyinit._bits.philox import stream_words
from keyinit._draw import reference_fill
from keyinit._draw.geometry import coalesce_high

__all__ = ["V2", "DEFAULT_FORWARD_STREAM", "names_strides", "check_samples", "named_words", "words_at", "names_at",
           "naming", "naming_shape", "fill", "fill_named", "named_geometry", "LO_SECOND", "HI_SAMPLE", "LIMITS",
           "HIGH_BITS", "MAX_SAMPLES"]

#: The stream version whose keyed forwards use these names.
V2 = "v2"
#: The stream of a ``keyed()`` block whose ``stream`` is not given (an int seed or a :class:`keyinit.Key`
#: alike: ``keyed(m, 7)`` and ``keyed(m, keyinit.key(7))`` are the same block).
DEFAULT_FORWARD_STREAM = V2
#: Bits of the low index below the second coordinate (for one word per element).
LO_SECOND = 34
#: Bits of the high counter words below the sample.
HI_SAMPLE = 32
#: Exclusive limits of the coordinates, innermost first, and of the sample (with at most three coordinates;
#: beyond three, coordinates 3 .. k share the ``HIGH_BITS`` of counter word 2, ``HIGH_BITS // (k - 2)`` each).
LIMITS = (1 << 32, 1 << 29, 1 << 32)
HIGH_BITS = 32
MAX_SAMPLES = 1 << 31


def names_strides(sample_shape: Sequence[int], words_per_element: int = 1,
                  what: str = "a keyed activation") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(lo_strides, hi_strides)`` of the canonical tensor ``(count, *sample_shape)``, one per dimension
    (the sample's first): the element at canonical position ``(r, j_1, ...)`` of sample ``start + r`` has
    ``lo = sum lo_strides[d] * pos_d`` and ``hi = sum hi_strides[d] * pos_d`` (plus ``start`` times
    ``hi_strides[0]``)."""
    if words_per_element not in (1, 2, 4):
        raise ValueError(f"words_per_element must divide 4, got {words_per_element}")
    shape = tuple(int(n) for n in sample_shape)
    lo = [0] * (len(shape) + 1)
    hi = [0] * (len(shape) + 1)
    hi[0] = 1 << HI_SAMPLE
    k = sum(1 for n in shape if n != 1)
    shared = max(k - 2, 1)  # coordinates 3 .. k share the 32 bits of counter word 2
    width = HIGH_BITS // shared
    coordinate = 0
    for d in range(len(shape) - 1, -1, -1):
        n = shape[d]
        if n == 1:
            continue
        limit = LIMITS[coordinate] if coordinate < 2 or k <= 3 else 1 << width
        if n > limit:
            raise ValueError(
                f"{what}: dimension {d + 1} of extent {n} exceeds stream v2's limit of {limit} for coordinate "
                f"{coordinate + 1} of a sample with {k} coordinates (sample shape {shape}; docs/spec.md 14.8)"
                + ("; flatten some dimensions first, or key this forward with keyinit.nn.keyed(..., stream='v1')"
                   if k > 3 else ""))
        if coordinate == 0:
            lo[d + 1] = 1
        elif coordinate == 1:
            lo[d + 1] = (1 << LO_SECOND) // words_per_element
        else:
            hi[d + 1] = 1 << (width * (coordinate - 2))
        coordinate += 1
    return tuple(lo), tuple(hi)


def check_samples(start: int, count: int, what: str = "a keyed activation") -> None:
    """Samples ``start .. start + count - 1`` fit stream v2's sample word."""
    if start < 0 or start + count > MAX_SAMPLES:
        raise ValueError(f"{what}: samples {start}..{start + count - 1} are outside stream v2's [0, 2**31) "
                         "(docs/spec.md 14.8)")


def named_words(key, start: int, sample_shape: Sequence[int], count: int,
                words_per_element: int = 1) -> list[torch.Tensor]:
    """The reference: the ``words_per_element`` stream words of every element of the canonical tensor
    ``(count, *sample_shape)`` whose row ``r`` is sample ``start + r``, as int64 tensors of that shape (CPU)."""
    shape = (int(count),) + tuple(int(n) for n in sample_shape)
    check_samples(start, count)
    lo_strides, hi_strides = names_strides(shape[1:], words_per_element)
    flat = torch.arange(_numel(shape), dtype=torch.int64)
    return [w.reshape(shape) for w in words_at(key, start, shape, flat, words_per_element, lo_strides, hi_strides)]


def words_at(key, start: int, shape: Sequence[int], flat: torch.Tensor, words_per_element: int,
             lo_strides: Sequence[int], hi_strides: Sequence[int]) -> list[torch.Tensor]:
    """The stream words of the elements at row-major positions ``flat`` of the canonical tensor ``shape``
    (row ``r``: sample ``start + r``) with the strides of :func:`names_strides`."""
    lo, hi = names_at(start, shape, flat, lo_strides, hi_strides)
    return stream_words(key.words, lo, words_per_element, hi)


def names_at(start: int, shape: Sequence[int], flat: torch.Tensor, lo_strides: Sequence[int],
             hi_strides: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` (int64, CPU) of the elements at row-major positions ``flat`` of the canonical tensor
    ``shape`` (row ``r``: sample ``start + r``): each one's low index and high counter words."""
    flat = flat.to(torch.int64).cpu()
    lo = torch.zeros_like(flat)
    hi = torch.full_like(flat, int(start) * hi_strides[0])
    rest = flat
    for size, ls, hs in zip(reversed(tuple(shape)), reversed(tuple(lo_strides)), reversed(tuple(hi_strides))):
        at = rest % size
        rest = rest // size
        if ls:
            lo += ls * at
        if hs:
            hi += hs * at
    return lo, hi


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ------------------------------------------------------------------ draws of random ops in keyed forwards

#: The sample shape of the canonical tensor a keyed forward's random op is being drawn on, per thread
#: (set by :func:`naming` around that one draw; read by :func:`keyinit._draw.dispatch.fill`).
_NAMING = threading.local()


@contextlib.contextmanager
def naming(sample_shape: Sequence[int]) -> Iterator[None]:
    """While open, a fill of a v2 key on this thread draws the canonical tensor ``(rows, *sample_shape)``
    (a region of row-major positions of it) by the elements' extent-free names: what a keyed forward's
    random op on samples does (:mod:`keyinit._engine.keyed.keyed_op`)."""
    previous = getattr(_NAMING, "shape", None)
    _NAMING.shape = tuple(int(n) for n in sample_shape)
    try:
        yield
    finally:
        _NAMING.shape = previous


def naming_shape() -> Optional[tuple[int, ...]]:
    """The sample shape of the :func:`naming` open on this thread, or ``None``."""
    return getattr(_NAMING, "shape", None)


def fill(out: torch.Tensor, dist: Any, key: Any, region: Any) -> None:
    """Stream v2's fill reference: :func:`fill_named` while :func:`naming` is open, else the element stream's
    values (:func:`keyinit._draw.reference_fill.fill`, v1's)."""
    if not fill_named(out, dist, key, region):
        reference_fill.fill(out, dist, key, region)


def named_geometry(out: torch.Tensor, region: Any, sample_shape: Sequence[int], words_per_element: int
                   ) -> Optional[tuple[int, int, list[list], Optional[torch.Tensor]]]:
    """:func:`fill_named`'s draw into ``out`` as the fill kernels take it: ``(base, high_base, dims,
    high_index)``, dims ``[size, out_stride, low_stride, index, high_stride]`` outermost first
    (:func:`keyinit._draw.geometry.coalesce_high`): element ``(p_0, ...)`` of ``out`` reads low index
    ``base + sum_k low_stride_k * idx_k(p_k)`` and high counter words ``high_base + sum_k high_stride_k *
    idx_k(p_k)``, or ``high_index[p]`` for the one dim of a ``high_index``. ``None`` where the draw has no such
    form (the reference draws it). The errors of :func:`fill_named` (too many coordinates, samples out of
    range) are raised here alike."""
    sample_shape = tuple(int(n) for n in sample_shape)
    lo_strides, hi_strides = names_strides(sample_shape, words_per_element)
    per = _numel(sample_shape)
    if tuple(region.shape[1:]) == sample_shape and region.shape:
        # the region's dimensions are the canonical tensor's: each adds lo and hi strides of its own
        first = region.entries[0]
        rows = first if isinstance(first, range) else None
        if out.shape[0]:
            last_row = max(rows[0], rows[-1]) if rows is not None else int(first.max())
            check_samples(last_row, 1)

        def dims_in():
            for entry, n, ostride, ls, hs in zip(region.entries, out.shape, out.stride(), lo_strides, hi_strides):
                if isinstance(entry, range):
                    yield n, ostride, entry.step * ls, entry.start * ls, None, entry.step * hs, entry.start * hs
                else:
                    yield n, ostride, ls, 0, entry, hs, 0

        base, high, dims = coalesce_high(dims_in())
        return base, high, dims, None
    if out.dim() != 1:
        return None
    # any other region of row-major positions (a lazily evaluated draw's): each element's names, listed
    flat = region.flat_indices(0, region.numel)
    check_samples(int(flat.max()) // max(per, 1), 1)
    lo, hi = names_at(0, (MAX_SAMPLES,) + sample_shape, flat, lo_strides, hi_strides)
    return 0, 0, [[int(out.shape[0]), int(out.stride(0)), 1, lo.contiguous(), 0]], hi.contiguous()


def fill_named(out: torch.Tensor, dist: Any, key: Any, region: Any) -> bool:
    """``out = dist``'s values at the names of ``region``'s positions when :func:`naming` is open and ``key``
    is of stream v2 (``True``); else ``False``, nothing written."""
    sample_shape = getattr(_NAMING, "shape", None)
    if sample_shape is None or key.stream != V2:
        return False
    w = dist.words_per_element
    lo_strides, hi_strides = names_strides(sample_shape, w)
    shape = (MAX_SAMPLES,) + sample_shape
    flat = region.flat_indices(0, region.numel)
    if flat.numel():
        per = _numel(sample_shape)
        check_samples(int(flat.max()) // max(per, 1), 1)
    values = dist.transform(words_at(key, 0, shape, flat, w, lo_strides, hi_strides))
    out.copy_(values.to(out.dtype).reshape(out.shape))
    return True
