"""Dropout keys: ``dropout_key(seed, step=, fqn=, ordinal=)``, domain-separated from parameter keys.

Derivation (stream v1, ``docs/spec.md`` section 14)::

    K = key(seed)                        # or the Key given as the root
    K = fold_in(K, DROPOUT_DOMAIN)       # an INT fold: init keys start with a STRING fold
    K = fold_in(K, step)                 # int
    K = fold_in(K, c) for each component c of fqn, in order   # str; none for the root module ""
    K = fold_in(K, ordinal)              # int: the call's ordinal in that module's forward

Parameter keys ``key_for(seed, fqn)`` fold only strings into ``key(seed)``, so
their first derivation uses Philox counter word 2 = 3, while every dropout key
starts with an int fold (word 2 = 2): the two families never share a Philox
input block under the root key, and a dropout mask is unrelated to every
weight whatever the FQNs.
"""

from __future__ import annotations

import functools
from typing import Any, Union

from keyinit._bits.streams import derives_as_v1
from keyinit._kernels.fill.folds import fold_words_v1, kernel_library
from keyinit.keys import Key, as_uint64, derived_key, fold_in, key

__all__ = ["DROPOUT_DOMAIN", "dropout_key"]

#: The int folded into the root key first: the ASCII bytes of "dropout" read as a big-endian integer.
DROPOUT_DOMAIN = int.from_bytes(b"dropout", "big")


def check_fqn(fqn: object) -> tuple[str, ...]:
    if not isinstance(fqn, str):
        raise TypeError(f"fqn must be a str (a module's canonical FQN, '' for the root), got {type(fqn).__name__}")
    if fqn == "":
        return ()
    parts = tuple(fqn.split("."))
    if any(not part for part in parts):
        raise ValueError(f"fqn must be '' or non-empty dot-separated names, got {fqn!r}")
    return parts


def _fold(words: tuple[int, int], stream: str, data: Union[int, str], lib: Any) -> tuple[int, int]:
    """The words of ``fold_in(Key(*words, stream), data)``: the Philox in C where ``lib`` (the CPU fill
    library, checked against ``fold_in`` when it loads) is given and the stream derives keys as v1 (v1, v2),
    else ``fold_in`` (which also says what is wrong with ``data``)."""
    if lib is not None and derives_as_v1(stream):
        found = fold_words_v1(lib, words[0], words[1], data)
        if found is not None:
            return found
    return fold_in(Key(words[0], words[1], stream), data).words


@functools.lru_cache(maxsize=4096)
def _module_words(k0: int, k1: int, stream: str, step: int, parts: tuple[str, ...], lib: Any) -> tuple[int, int]:
    """The words of ``dropout_key`` before the ordinal fold, for the root key ``(k0, k1)`` of ``stream``
    (memoized by ints and strings, hashed in C: a pure function of them; prefixes shared; ``lib`` is
    only how the words are computed, not what they are)."""
    if not parts:
        return _fold(_fold((k0, k1), stream, DROPOUT_DOMAIN, lib), stream, step, lib)
    return _fold(_module_words(k0, k1, stream, step, parts[:-1], lib), stream, parts[-1], lib)


class CallKeys:
    """The keys keyed() gives the calls of one root forward (its root key and step fixed):
    ``keys(fqn, ordinal)`` is ``dropout_key(root, step=step, fqn=fqn, ordinal=ordinal)``. Each module's
    words before the ordinal fold are derived once, the kernel library is looked up once (a forward's
    calls all ask; where the words are computed never changes what they are), and the ordinal is folded
    in C where the library is loaded (a call's key is new at every step)."""

    __slots__ = ("root", "step", "words", "lib", "fold")

    def __init__(self, root: Key, step: int) -> None:
        self.root, self.step = root, step
        self.words: dict[str, tuple[int, int]] = {}
        self.lib = kernel_library() if derives_as_v1(root.stream) else None
        self.fold = fold_words_v1

    def __call__(self, fqn: str, ordinal: int) -> Key:
        words = self.words.get(fqn) or self._module(fqn)
        if self.lib is not None:
            found = self.fold(self.lib, words[0], words[1], ordinal)
            if found is not None:
                return derived_key(found[0], found[1], self.root.stream)
        k0, k1 = _fold(words, self.root.stream, ordinal, None)
        return derived_key(k0, k1, self.root.stream)

    def below(self, fqn: str, data: tuple) -> Key:
        """``keyed_module_key(root, step, fqn)`` with each of ``data`` folded in, in order."""
        words = self.words.get(fqn) or self._module(fqn)
        for item in data:
            words = _fold(words, self.root.stream, item, self.lib)
        return derived_key(words[0], words[1], self.root.stream)

    def _module(self, fqn: str) -> tuple[int, int]:
        root = self.root
        words = self.words[fqn] = _module_words(root.k0, root.k1, root.stream, self.step, _fqn_parts(fqn), self.lib)
        return words


@functools.lru_cache(maxsize=4096)
def _fqn_parts(fqn: str) -> tuple[str, ...]:
    return check_fqn(fqn)


def keyed_module_key(root: Key, step: int, fqn: str) -> Key:
    """``dropout_key`` before its ordinal fold: ``fold_in(fold_in(R, DROPOUT_DOMAIN), step)`` then fqn's parts."""
    stream = root.stream
    words = _module_words(root.k0, root.k1, stream, step, check_fqn(fqn), kernel_library())
    return derived_key(words[0], words[1], stream)


def dropout_key(seed: Union[int, Key], *, step: int, fqn: str = "", ordinal: int = 0) -> Key:
    """The key of the dropout call number ``ordinal`` in the forward of module ``fqn`` at ``step``.

    ``seed`` is an int in ``[0, 2**64)`` (or a :class:`~keyinit.Key` used as the root);
    ``step`` and ``ordinal`` are ints in ``[0, 2**64)``; ``fqn`` is the module's
    canonical FQN (``""`` for the root module). This is the key
    :func:`keyinit.nn.keyed` gives each call::

        K = fold_in(key(seed), DROPOUT_DOMAIN)
        K = fold_in(K, step); K = fold_in(K, c) for c in fqn.split("."); K = fold_in(K, ordinal)
    """
    root = seed if isinstance(seed, Key) else key(seed)
    step = as_uint64(step, "step")
    ordinal = as_uint64(ordinal, "ordinal")
    derived = fold_in(fold_in(root, DROPOUT_DOMAIN), step)
    for part in check_fqn(fqn):
        derived = fold_in(derived, part)
    return fold_in(derived, ordinal)
