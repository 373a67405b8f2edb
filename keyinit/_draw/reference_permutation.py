"""The keyed permutation of stream v1 (``docs/spec.md`` section 16), reference implementation.

A bijection of ``range(n)`` for every ``1 <= n <= 2**62``, evaluated at any
positions without touching the others::

    Kp = fold_in(fold_in(K, PERMUTE_DOMAIN), n)           # int folds (tag 2)
    b  = bit_length(n - 1); rb = b // 2; lb = b - rb      # x = (l << rb) | r
    R  = 12 if b <= 16 else 6                            # rounds
    E(x): for i in 0 .. R-1:
              if i even: l ^= F(i, r) & (2**lb - 1)
              else:      r ^= F(i, l) & (2**rb - 1)
          F(i, v) = Philox((v, i, 0, 0), Kp)[0]
    perm(p) = E(p), then E again while the value is >= n  (cycle walking)

Small domains get twice the rounds: with few bits per half the round functions
have few inputs, and six rounds measurably bias where cycle walking lands
(``n = 5..7``); twelve do not, and cost nothing at that size.

Each round changes one half by a function of the other, so it is invertible
whatever the split (odd ``b`` gives ``lb = rb + 1``); ``E`` is a permutation of
``[0, 2**b)`` and cycle walking restricts it to ``[0, n)``. Everything is exact
integer arithmetic on int64 tensors holding values below ``2**62``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from keyinit._bits.philox import philox4x32
from keyinit.keys import Key, fold_in

__all__ = ["PERMUTE_DOMAIN", "rounds", "MAX_N", "permutation_key", "geometry", "encrypt", "decrypt",
           "permute_reference", "unpermute_reference", "permute_into"]

#: The int folded in first: the ASCII bytes of "permute", big-endian.
PERMUTE_DOMAIN = int.from_bytes(b"permute", "big")
SMALL_BITS = 16
MAX_N = 1 << 62
_MASK32 = 0xFFFFFFFF


@functools.lru_cache(maxsize=256)
def permutation_key(key: Key, n: int) -> Key:
    """``Kp = fold_in(fold_in(key, PERMUTE_DOMAIN), n)``: the key of the rounds."""
    return fold_in(fold_in(key, PERMUTE_DOMAIN), n)


def geometry(n: int) -> tuple[int, int]:
    """``(lb, rb)``: the bit widths of the left and right halves for domain size ``n``."""
    b = (n - 1).bit_length()
    return b - b // 2, b // 2


def rounds(lb: int, rb: int) -> int:
    """The number of Feistel rounds for a domain of ``lb + rb`` bits."""
    return 12 if lb + rb <= SMALL_BITS else 6


def _round_value(kp: tuple[int, int], i: int, v: torch.Tensor) -> torch.Tensor:
    return philox4x32((v, torch.full_like(v, i), torch.zeros_like(v), torch.zeros_like(v)), kp)[0]


def encrypt(kp: tuple[int, int], lb: int, rb: int, x: torch.Tensor) -> torch.Tensor:
    """One pass of the Feistel network over ``[0, 2**(lb+rb))`` (int64 in, int64 out)."""
    lmask, rmask = (1 << lb) - 1, (1 << rb) - 1
    left, right = x >> rb, x & rmask
    for i in range(rounds(lb, rb)):
        if i % 2 == 0:
            left = left ^ (_round_value(kp, i, right) & lmask)
        else:
            right = right ^ (_round_value(kp, i, left) & rmask)
    return (left << rb) | right


def decrypt(kp: tuple[int, int], lb: int, rb: int, y: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`encrypt`: the rounds undone in reverse order."""
    lmask, rmask = (1 << lb) - 1, (1 << rb) - 1
    left, right = y >> rb, y & rmask
    for i in reversed(range(rounds(lb, rb))):
        if i % 2 == 0:
            left = left ^ (_round_value(kp, i, right) & lmask)
        else:
            right = right ^ (_round_value(kp, i, left) & rmask)
    return (left << rb) | right


def _walk(step, kp: tuple[int, int], n: int, x: torch.Tensor) -> torch.Tensor:
    lb, rb = geometry(n)
    y = step(kp, lb, rb, x)
    pending = (y >= n).nonzero().reshape(-1)
    while pending.numel():
        values = step(kp, lb, rb, y[pending])
        y[pending] = values
        pending = pending[values >= n]
    return y


def permute_reference(key: Key, n: int, positions: torch.Tensor) -> torch.Tensor:
    """``perm[positions]`` of the keyed permutation of ``range(n)`` (int64, any device)."""
    if n == 1:
        return torch.zeros_like(positions)
    return _walk(encrypt, permutation_key(key, n).words, n, positions.to(torch.int64))


def unpermute_reference(key: Key, n: int, values: torch.Tensor) -> torch.Tensor:
    """The positions of ``values`` in the keyed permutation of ``range(n)``."""
    if n == 1:
        return torch.zeros_like(values)
    return _walk(decrypt, permutation_key(key, n).words, n, values.to(torch.int64))


def permute_into(kp: tuple[int, int], n: int, inverse: bool, out: torch.Tensor, *,
                 positions: Optional[torch.Tensor] = None, start: int = 0, step: int = 1) -> bool:
    """The reference with the kernels' signature (``keyinit._draw.dispatch``'s permutation family).

    ``out[k] = perm(p_k)`` (``inverse``: ``perm^-1(p_k)``) under the round key ``kp``, with
    ``p_k = positions[k]`` or ``start + step * k``; ``out`` is int64, ``positions`` (if given)
    has its shape and device, and both are read in row-major order, as the kernels do.
    """
    if positions is None:
        flat = start + step * torch.arange(out.numel(), dtype=torch.int64, device=out.device)
    else:
        flat = positions.reshape(-1).to(torch.int64)
    values = _walk(decrypt if inverse else encrypt, kp, n, flat)
    out.copy_(values.reshape(out.shape))
    return True
