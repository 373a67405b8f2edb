"""Triton kernel of the keyed permutation (CUDA tensors), bit-identical to the C kernel and the reference.

Imported lazily by :mod:`keyinit.data._permutation` (falls back to the reference
when triton is missing). Under ``TRITON_INTERPRET=1`` it runs on CPU tensors
(``interpret_ok=True``), which is how the tests check it without a GPU.

Each program takes BLOCK positions (an int64 vector, or ``start + step*k``),
applies the Feistel rounds (12 for domains of at most 16 bits, else 6) of ``docs/spec.md`` section 16 (round function
``Philox((v, i, 0, 0), Kp)[0]``, the same ``philox`` as the init kernel) and
re-applies them to the lanes still ``>= n`` until none is (cycle walking; a
scalar ``while`` over the block's maximum).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from keyinit._kernels.common.triton_philox import philox  # Philox4x32-10 of (c0, c1, 0, 0) under (k0, k1)

__all__ = ["run", "BLOCK"]

BLOCK = 1024


@triton.jit
def _feistel(x, key0, key1, lb, rb, lmask, rmask, INVERSE: tl.constexpr, ROUNDS: tl.constexpr):
    left = (x >> rb).to(tl.uint32)
    right = (x & rmask).to(tl.uint32)
    for s in tl.static_range(ROUNDS):
        if INVERSE:
            i = ROUNDS - 1 - s
        else:
            i = s
        if i % 2 == 0:
            f, _, _, _ = philox(right, tl.zeros_like(right) + i, key0, key1)
            left = left ^ (f & lmask.to(tl.uint32))
        else:
            f, _, _, _ = philox(left, tl.zeros_like(left) + i, key0, key1)
            right = right ^ (f & rmask.to(tl.uint32))
    return (left.to(tl.int64) << rb) | right.to(tl.int64)


@triton.jit(do_not_specialize=["count", "n", "k0", "k1", "lb", "rb", "start", "step"])
def _permute_kernel(pos_ptr, out_ptr, count, n, k0, k1, lb, rb, start, step,
                    INDEXED: tl.constexpr, INVERSE: tl.constexpr, ROUNDS: tl.constexpr,
                    BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < count
    if INDEXED:
        x = tl.load(pos_ptr + offs, mask=mask, other=0)
    else:
        x = tl.where(mask, start + step * offs, 0)
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    key0 = zero + k0.to(tl.uint32)
    key1 = zero + k1.to(tl.uint32)
    lmask = (tl.zeros([BLOCK], dtype=tl.int64) + 1 << lb) - 1
    rmask = (tl.zeros([BLOCK], dtype=tl.int64) + 1 << rb) - 1
    y = _feistel(x, key0, key1, lb, rb, lmask, rmask, INVERSE, ROUNDS)
    pending = tl.max((y >= n).to(tl.int32), axis=0)
    while pending > 0:
        again = _feistel(y, key0, key1, lb, rb, lmask, rmask, INVERSE, ROUNDS)
        y = tl.where(y >= n, again, y)
        pending = tl.max((y >= n).to(tl.int32), axis=0)
    tl.store(out_ptr + offs, y, mask=mask)


def run(kp: tuple[int, int], n: int, inverse: bool, out: torch.Tensor, *, positions: Optional[torch.Tensor] = None,
        start: int = 0, step: int = 1, interpret_ok: bool = False) -> bool:
    """As :func:`keyinit._kernels.permutation.cpu.run`, for CUDA tensors (CPU only with ``interpret_ok``)."""
    if out.device.type != "cuda" and not interpret_ok:
        return False
    count = out.numel()
    if count == 0:
        return True
    b = (n - 1).bit_length()
    rb = b // 2
    lb = b - rb
    grid = (triton.cdiv(count, BLOCK),)
    pos = positions if positions is not None else out  # unread when not INDEXED
    args = (pos, out, count, n, kp[0], kp[1], lb, rb, start, step)
    options = dict(INDEXED=positions is not None, INVERSE=bool(inverse), ROUNDS=12 if b <= 16 else 6, BLOCK=BLOCK)
    if out.device.type == "cuda":
        with torch.cuda.device(out.device):
            _permute_kernel[grid](*args, **options)
    else:
        _permute_kernel[grid](*args, **options)
    return True
