"""Triton kernel for stream v1 (CUDA tensors), bit-identical to :mod:`keyinit._reference`.

Triton is optional: this module imports it lazily, and :func:`fill` returns
``False`` (so the caller falls back to the reference) when it is missing.

Bit-exactness on a GPU needs three things, all done here:

- IEEE division and square root: ``tl.math.div_rn`` and ``tl.math.sqrt_rn``
  (Triton's ``/`` and ``tl.sqrt`` on fp32 may be approximate);
- no contraction of ``a * b + c`` into FMA: every launch passes
  ``enable_fp_fusion=False``;
- no library transcendental: ``log`` and ``ndtri`` are the binary32 sequences of
  :mod:`keyinit._fp32math`, operation for operation.

Philox4x32-10 is written out here (``umulhi`` plus a wrapping multiply), with
the counter ``(lo32(b), hi32(b), 0, 0)`` of block ``b = (w * i) // 4``; Triton's
own ``randint4x`` puts a 64-bit offset into a different Philox variant, so it is
not used. bfloat16 rounding is done on the bits (torch's rule); float16 uses the
hardware round-to-nearest-even conversion.

Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (numpy
semantics, IEEE binary32), which is how the tests check it without a GPU.
"""

from __future__ import annotations

import functools

import torch

from keyinit.distributions import Bernoulli, Bits, Distribution, Normal, Randint, TruncatedNormal, Uniform
from keyinit.keys import Key
from keyinit.regions import Region

__all__ = ["available", "fill", "MAX_DIMS", "BLOCK"]

MAX_DIMS = 8
BLOCK = 1024

_DISTS = {Bits: 0, Uniform: 1, Normal: 2, TruncatedNormal: 3, Bernoulli: 4, Randint: 5}
# Output kinds: how the kernel stores a value.
_OUT_KINDS = {
    torch.float32: 0,
    torch.float64: 1,
    torch.bfloat16: 2,  # stored as int16 bits
    torch.float16: 3,
    torch.bool: 4,  # stored as uint8
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
}


@functools.lru_cache(maxsize=None)
def _kernel():
    """The jitted Triton kernel; ``None`` when triton cannot be imported."""
    try:
        from keyinit._kernels._triton_impl import fill_kernel
    except Exception:  # noqa: BLE001 - any import failure means: not available
        return None
    return fill_kernel


def available() -> bool:
    return _kernel() is not None


def _storage_view(out: torch.Tensor) -> torch.Tensor:
    """``out`` as the tensor the kernel stores into (bf16 as int16 bits, bool as uint8)."""
    if out.dtype == torch.bfloat16:
        return out.view(torch.int16)
    if out.dtype == torch.bool:
        return out.view(torch.uint8)
    return out


def fill(out: torch.Tensor, dist: Distribution, key: Key, region: Region, *, interpret_ok: bool = False) -> bool:
    """Fill ``out`` with the Triton kernel; ``False`` (nothing written) if it cannot.

    Runs for CUDA tensors; CPU tensors are accepted only with ``interpret_ok``
    (the tests, under ``TRITON_INTERPRET=1``).
    """
    dist_id = _DISTS.get(type(dist))
    out_kind = _OUT_KINDS.get(out.dtype)
    if dist_id is None or out_kind is None:
        return False
    if out.device.type != "cuda" and not interpret_ok:
        return False
    kernel = _kernel()
    if kernel is None:
        return False
    numel = out.numel()
    if numel == 0:
        return True
    base = 0
    rows: list[list[int]] = []
    pieces: list[torch.Tensor] = []
    offset = 0
    for index, gstride, n, ostride in zip(region.indices, region.strides, out.shape, out.stride()):
        if n == 1:
            base += int(index[0]) * gstride
            continue
        rows.append([n, ostride, gstride, offset])
        pieces.append(index)
        offset += n
    if not rows:
        rows.append([1, 1, 0, 0])
        pieces.append(torch.zeros(1, dtype=torch.int64))
    if len(rows) > MAX_DIMS:
        return False
    meta = torch.tensor(rows, dtype=torch.int64).reshape(-1).to(out.device)
    index_all = torch.cat(pieces).to(out.device)
    fa = fb = p_low = p_span = lower = upper = 0.0
    flip = threshold = ilow = ispan = 0
    if isinstance(dist, Uniform):
        fa, fb = dist.low, dist.span
    elif isinstance(dist, Normal):
        fa, fb = dist.mean, dist.std
    elif isinstance(dist, TruncatedNormal):
        fa, fb, p_low, p_span, lower, upper = dist.mean, dist.std, dist.p_low, dist.p_span, dist.lower, dist.upper
        flip = int(dist.flip)
    elif isinstance(dist, Bernoulli):
        threshold = dist.threshold
    elif isinstance(dist, Randint):
        ilow, ispan = dist.low, dist.span
    k0, k1 = key.words
    grid = ((numel + BLOCK - 1) // BLOCK,)
    args = (_storage_view(out), meta, index_all, numel, base, k0, k1,
            float(fa), float(fb), float(p_low), float(p_span), float(lower), float(upper),
            flip, threshold, ilow, ispan)
    options = dict(NDIM=len(rows), DIST=dist_id, OUT=out_kind, BLOCK=BLOCK, enable_fp_fusion=False)
    if out.device.type == "cuda":
        with torch.cuda.device(out.device):
            kernel[grid](*args, **options)
    else:  # the interpreter (tests)
        kernel[grid](*args, **options)
    # The write bypassed torch's in-place ops, so bump the version counter as they would.
    torch.autograd.graph.increment_version(out)
    return True
