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
from typing import Union

from keyinit.keys import Key, as_uint64, fold_in, key

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


def _fold(parent: Key, data: Union[int, str]) -> Key:
    """``fold_in(parent, data)``, its Philox in C where the CPU fill library is loaded (the keyed data
    paths' derivation, checked against ``fold_in`` when the library loads): a new step derives a key per
    module and call."""
    from keyinit.data._fill import fold_with, kernel_library

    return fold_with(kernel_library(), parent, data)


@functools.lru_cache(maxsize=4096)
def _module_key(root: Key, step: int, parts: tuple[str, ...]) -> Key:
    """``dropout_key`` before the ordinal fold (memoized: a pure function of immutable values; prefixes shared)."""
    if not parts:
        return _fold(_fold(root, DROPOUT_DOMAIN), step)
    return _fold(_module_key(root, step, parts[:-1]), parts[-1])


@functools.lru_cache(maxsize=8192)
def _call_key(root: Key, step: int, fqn: str, ordinal: int) -> Key:
    return _fold(_module_key(root, step, check_fqn(fqn)), ordinal)


def keyed_call_key(root: Key, step: int, fqn: str, ordinal: int) -> Key:
    """``dropout_key(root, step=step, fqn=fqn, ordinal=ordinal)`` for a root key and validated ints (what
    ``keyed`` asks for each call), memoized."""
    return _call_key(root, step, fqn, ordinal)


def keyed_module_key(root: Key, step: int, fqn: str) -> Key:
    """``dropout_key`` before its ordinal fold: ``fold_in(fold_in(R, DROPOUT_DOMAIN), step)`` then fqn's parts."""
    return _module_key(root, step, check_fqn(fqn))


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
