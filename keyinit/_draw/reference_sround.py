"""The reference of keyed stochastic rounding over a region: plain torch integer ops, chunked.

Element ``(p_0, ..., p_{d-1})`` of the input, which holds ``full[region]`` of a tensor of the region's
global shape, is rounded with stream word ``word(K, i)`` of its global flat index ``i``
(``docs/spec.md`` section 17; the word that ``uniform`` and ``bits`` use for element ``i``), so a region
or shard rounds exactly as the whole tensor does. It runs on any device.
"""

from __future__ import annotations

import torch

from keyinit._bits.sround import E2M1, TARGETS, round_bits, to_dtype
from keyinit._draw.reference_fill import CHUNK_ELEMENTS, scatter_strided
from keyinit.keys import Key, key_for
from keyinit.regions import Region

__all__ = ["round_into", "round_fp4_into", "adam_values", "adam_into"]


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


def round_fp4_into(out: torch.Tensor, v: torch.Tensor, key: Key, region: Region,
                   chunk_elements: int = CHUNK_ELEMENTS) -> None:
    """Write ``v`` (float64, already divided by its scale, no NaN; shaped like ``region``) rounded
    stochastically to FP4 E2M1 (``docs/spec.md`` 17.7) into ``out`` (uint8, same shape): each element's
    4-bit code (sign bit 3) in its low bits, torchao's unpacked layout."""
    source = v.detach().reshape(-1)
    words_of = key.impl.words
    flat_out = out.view(-1) if out.is_contiguous() else None
    for start, stop in region.chunks(chunk_elements):
        element = region.flat_indices(start, stop).to(out.device)
        (words,) = words_of(key.words, element, 1)
        values = round_bits(source[start:stop].to(out.device), words, E2M1).to(torch.uint8)
        if flat_out is not None:
            flat_out[start:stop] = values
        else:
            scatter_strided(out, start, stop, values)


# ------------------------------------------------------------------------ the fused Adam step (spec 17.6)


def _f32(x: torch.Tensor) -> torch.Tensor:
    """A float64 holding an exact result of binary32 operands, rounded once to binary32 and widened back:
    for +, -, *, / and sqrt of binary32 values, rounding the (correctly rounded) binary64 result again
    gives the correctly rounded binary32 one (53 >= 2 * 24 + 2)."""
    return x.to(torch.float32).to(torch.float64)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """binary32 ``fma(a, b, c)`` (one rounding) of binary32 values held in float64: ``a * b`` is exact in
    binary64, the sum is made round-to-odd there (its exact error by TwoSum), and round-to-odd at 53 bits
    then round-to-nearest at 24 is the correctly rounded result."""
    p = a * b
    s = p + c
    bp = s - p
    err = (p - (s - bp)) + (c - bp)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where((err != 0) & even & torch.isfinite(s), torch.nextafter(s, toward), s)
    return _f32(s)


def adam_values(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                scalars: "list[float]", has_decay: bool) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """The new float32 parameter, ``exp_avg`` and ``exp_avg_sq`` of one fused Adam/AdamW step
    (``docs/spec.md`` 17.6), each operation of binary32 operands rounded once to binary32, on any device.
    ``scalars``: decay, w, beta2, s2, bc2s, eps, neg_step (Python floats, rounded to binary32 here)."""
    decay, w, beta2, s2, bc2s, eps, neg_step = (float(torch.tensor(s, dtype=torch.float32)) for s in scalars)
    p = param.to(torch.float64)
    g = grad.to(torch.float64)
    m0 = exp_avg.to(torch.float64)
    v0 = exp_avg_sq.to(torch.float64)
    if has_decay:
        p = _f32(p * decay)
    d = _f32(g - m0)
    wt = torch.full_like(d, w if w < 0.5 else float(torch.tensor(w - 1.0, dtype=torch.float32)))
    m = _fma(wt, d, m0 if w < 0.5 else g)
    v = _fma(_f32(s2 * g), g, _f32(v0 * beta2))
    den = _f32(_f32(_f32(torch.sqrt(v)) / bc2s) + eps)
    new = _f32(_f32(_f32(neg_step * m) / den) + p)
    return new.to(torch.float32), m.to(torch.float32), v.to(torch.float32)


def adam_into(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              key: Key, region: Region, scalars: "list[float]", has_decay: bool) -> None:
    """The fused Adam/AdamW step (``docs/spec.md`` 17.6) in place: ``exp_avg``/``exp_avg_sq`` (float32) take
    their new values and ``param`` (bfloat16/float16: rounded stochastically with ``key`` at ``region``'s
    global indices; float32: as is) its new value."""
    new, m, v = adam_values(param, grad, exp_avg, exp_avg_sq, scalars, has_decay)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if param.dtype == torch.float32:
        param.copy_(new)
    else:
        round_into(param, new, key, region)


def adam_many(items: "list", base: Key) -> None:
    """The fused step of several parameters (``keyinit._draw.dispatch.AdamItem``), item by item: each
    :func:`adam_into` with the key ``key_for(base, fqn)``."""
    for item in items:
        adam_into(item.param, item.grad, item.exp_avg, item.exp_avg_sq, key_for(base, item.fqn), item.region,
                  item.scalars, item.has_decay)


def round_many(items: "list", base: Key) -> None:
    """Several roundings (``keyinit._draw.dispatch.RoundItem``), item by item: each :func:`round_into` with
    the key ``key_for(base, fqn)``."""
    for item in items:
        round_into(item.out, item.x, key_for(base, item.fqn), item.region)
