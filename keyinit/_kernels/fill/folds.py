"""Key folds by the CPU fill kernel's C Philox: ``fold_in`` of an int or a str, and the library that runs it.

:func:`kernel_library` is the CPU fill kernel's library (None where kernels are disabled or unavailable);
:func:`fold_words`, :func:`fold_words_v1` and :func:`fold_with` give ``keyinit.fold_in``'s words and keys,
the Philox of a derivation of a stream that derives keys as v1 (v1, v2) run in C where the library is
given (its self-test checks it against ``fold_in`` when it loads), else ``fold_in`` itself. Keyed data
(``keyinit.data``) and keyed forwards (``keyinit.nn``: dropout and host keys) fold keys at every sample
and step through these.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Union

from keyinit._bits.streams import derives_as_v1
from keyinit._draw.dispatch import kernels_disabled
from keyinit.keys import Key, derived_key, fold_in, fold_inputs

__all__ = ["kernel_library", "fold_words", "fold_words_v1", "fold_with"]

_MASK32 = 0xFFFFFFFF


@functools.lru_cache(maxsize=64)
def _counter(data: Union[int, str]) -> tuple[int, int, int, int]:
    """The stream v1 Philox counter ``(x0, x1, tag, x3)`` of ``fold_in(K, data)`` (constant strings: remembered)."""
    tag, (x0, x1, x3) = fold_inputs(data)
    return x0, x1, tag, x3


def fold_words(lib: Any, parent: Key, data: Union[int, str]) -> tuple[int, int]:
    """The words of ``fold_in(parent, data)``; with the kernel library ``lib`` (not None) the Philox of a key
    of a stream that derives as v1 (v1, v2) runs in C."""
    if lib is not None and derives_as_v1(parent.stream):
        if type(data) is int and 0 <= data <= 0xFFFFFFFFFFFFFFFF:
            words = lib.keyinit_derive(parent.k0, parent.k1, data & _MASK32, data >> 32, 2, 0)
            return words & _MASK32, words >> 32
        if type(data) is str:
            words = lib.keyinit_derive(parent.k0, parent.k1, *_counter(data))
            return words & _MASK32, words >> 32
    return fold_in(parent, data).words  # fold_in says what is wrong with data


def fold_words_v1(lib: Any, k0: int, k1: int, data: Union[int, str]) -> Optional[tuple[int, int]]:
    """The words of ``fold_in(Key(k0, k1, "v1"), data)`` by the C Philox of the kernel library ``lib``, or
    None where it does not apply (``data`` not an int in ``[0, 2**64)`` nor a str)."""
    if type(data) is int and 0 <= data <= 0xFFFFFFFFFFFFFFFF:
        words = lib.keyinit_derive(k0, k1, data & _MASK32, data >> 32, 2, 0)
    elif type(data) is str:
        words = lib.keyinit_derive(k0, k1, *_counter(data))
    else:
        return None
    return words & _MASK32, words >> 32


def fold_with(lib: Any, parent: Key, data: Union[int, str]) -> Key:
    """``fold_in(parent, data)``; with the kernel library ``lib`` (not None) the Philox of a key of a stream that
    derives as v1 (v1, v2) runs in C."""
    if lib is None or not derives_as_v1(parent.stream):
        return fold_in(parent, data)
    k0, k1 = fold_words(lib, parent, data)
    return derived_key(k0, k1, parent.stream)  # (words of a derivation: the checks of Key cannot fail)


_LIBRARY: list = []  # the CPU kernel library once loaded (loading it checks it: milliseconds)


def kernel_library() -> Any:
    """The CPU fill kernel's library, or None where kernels are disabled (``KEYINIT_DISABLE_KERNELS``,
    read on every call) or unavailable (resolve once per keyed call)."""
    if kernels_disabled():
        return None
    if not _LIBRARY:
        from keyinit._kernels.fill.cpu import library

        lib = library()
        if lib is None:
            return None
        _LIBRARY.append(lib)
    return _LIBRARY[0]
