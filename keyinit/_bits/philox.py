"""Philox4x32-10, the counter-based PRNG under every keyinit stream.

Philox (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11)
maps a 128-bit counter ``c = (c0, c1, c2, c3)`` and a 64-bit key
``k = (k0, k1)`` to 128 random bits. One round is::

    (hi0, lo0) = mulhilo32(M0, c0)
    (hi1, lo1) = mulhilo32(M1, c2)
    c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
    k = (k0 + W0 mod 2**32, k1 + W1 mod 2**32)

and Philox4x32-10 applies ten rounds (the key bump happens between rounds).

This module is the executable form of that definition and nothing more. It
works on Python ints (used to derive keys) and on int64 tensors that hold
uint32 values (used by the reference samplers). Every product is split into
16-bit halves so no int64 operation ever overflows: the result is exact on
any backend, with no reliance on wrap-around.
"""

from __future__ import annotations

from typing import TypeVar

import torch

__all__ = ["M0", "M1", "W0", "W1", "ROUNDS", "philox4x32", "stream_words"]

M0 = 0xD2511F53
M1 = 0xCD9E8D57
W0 = 0x9E3779B9
W1 = 0xBB67AE85
ROUNDS = 10

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF

Word = TypeVar("Word", int, torch.Tensor)


def _mulhilo32(multiplier: int, x: Word) -> tuple[Word, Word]:
    """Return ``(hi, lo)`` of the 64-bit product ``multiplier * x``.

    ``x`` holds values in ``[0, 2**32)``. With ``x = xh * 2**16 + xl``,
    ``multiplier * x = mid * 2**16 + (pl mod 2**16)`` where ``pl = multiplier * xl``
    and ``mid = multiplier * xh + pl // 2**16``; every intermediate is below
    ``2**49``.
    """
    low_product = (x & _MASK16) * multiplier
    mid = (x >> 16) * multiplier + (low_product >> 16)
    hi = mid >> 16
    lo = ((mid & _MASK16) << 16) | (low_product & _MASK16)
    return hi, lo


def _mulhilo_int(multiplier: int, x: int) -> tuple[int, int]:
    product = multiplier * x
    return product >> 32, product & _MASK32


def philox4x32(
    counter: tuple[Word, Word, Word, Word], key: tuple[int, int]
) -> tuple[Word, Word, Word, Word]:
    """Philox4x32-10 of ``counter`` under ``key``; all words in ``[0, 2**32)``.

    ``counter`` words may be Python ints or int64 tensors (broadcast together);
    the key is two Python ints.
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    # Python ints (every key derivation) take each 64-bit product whole; int64 tensors split it
    mulhilo = _mulhilo_int if all(type(c) is int for c in counter) else _mulhilo32
    for round_index in range(ROUNDS):
        if round_index:
            k0 = (k0 + W0) & _MASK32
            k1 = (k1 + W1) & _MASK32
        hi0, lo0 = mulhilo(M0, c0)
        hi1, lo1 = mulhilo(M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def stream_words(
    key: tuple[int, int], element_index: torch.Tensor, words_per_element: int,
    high: "torch.Tensor | int" = 0,
) -> list[torch.Tensor]:
    """The ``words_per_element`` stream words that each element consumes.

    Element ``i`` consumes words ``w*i .. w*i + w - 1`` of the stream of ``key``,
    and word ``j`` of that stream is lane ``j % 4`` of
    ``philox4x32((lo32(j // 4), hi32(j // 4), 0, 0), key)`` (the cuRAND offset
    convention, and Triton's ``randint4x(seed, j // 4)``).

    ``w`` must divide 4, so an element's words always lie in one Philox block.
    Returns ``w`` int64 tensors shaped like ``element_index``.

    ``high`` (an int or an int64 tensor broadcast with ``element_index``, in ``[0, 2**64)`` held as its
    two's complement) gives counter words 2 and 3, ``(lo32(high), hi32(high))``: 0 in the element stream
    of section 4; a keyed forward's extent-free names (``docs/spec.md`` 14.8) put a sample and a
    coordinate there.
    """
    if words_per_element not in (1, 2, 4):
        raise ValueError(f"words_per_element must divide 4, got {words_per_element}")
    first_word = element_index * words_per_element
    block = first_word >> 2
    if isinstance(high, int) and high == 0:
        c2 = c3 = torch.zeros_like(block)
    else:
        high = torch.as_tensor(high, dtype=torch.int64, device=block.device).expand_as(block)
        c2, c3 = high & _MASK32, (high >> 32) & _MASK32
    lanes = torch.stack(philox4x32((block & _MASK32, (block >> 32) & _MASK32, c2, c3), key))
    first_lane = (first_word & 3).unsqueeze(0)
    return [
        torch.gather(lanes, 0, first_lane + offset).squeeze(0)
        for offset in range(words_per_element)
    ]
