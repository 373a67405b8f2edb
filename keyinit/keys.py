"""Stateless keys: ``key``, ``split``, ``fold_in`` and ``key_for``.

A :class:`Key` is two 32-bit words plus the name of the stream version that
interprets them. Keys never change; deriving a key makes a new one. The name
resolves to the version's registered :class:`keyinit._bits.streams.Stream`
(``key.impl``), which says how a seed becomes a key, how keys are derived and
which kernels draw from them; every key derived from a key keeps its version.

Derivation in stream ``"v1"`` (see ``docs/spec.md``)::

    derive(K, tag, (x0, x1, x3)) = Philox4x32-10((x0, x1, tag, x3), K)[0:2]

    split(K, n)[i]   = derive(K, 1, (lo32(i), hi32(i), 0))
    fold_in(K, int d) = derive(K, 2, (lo32(d), hi32(d), 0))
    fold_in(K, str s) = derive(K, 3, (h0, h1, h2))   # h = SHA-256(utf-8 s), little-endian words

Element streams only use counters whose word 2 is zero, and the three kinds of
derivation use tags 1, 2 and 3 in that word. Philox is a bijection of the
counter for a fixed key, so the four domains never share an input block.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Optional, Union

import attrs

from keyinit._bits import streams

__all__ = ["Key", "key", "split", "fold_in", "fold_inputs", "key_for", "STREAM_VERSIONS", "DEFAULT_STREAM", "as_int",
           "as_int_in", "as_uint64", "require_key"]

DEFAULT_STREAM = "v1"

_TAG_SPLIT = 1
_TAG_FOLD_INT = 2
_TAG_FOLD_STR = 3
_MASK32 = 0xFFFFFFFF
_UINT64_LIMIT = 1 << 64


def _check_uint32(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MASK32:
        raise ValueError(f"key words must be ints in [0, 2**32), got {value!r}")
    return value


def __getattr__(name: str) -> tuple[str, ...]:
    """``STREAM_VERSIONS``: the names of the registered stream versions (:data:`keyinit._bits.streams.STREAMS`,
    the one source of truth), read at each access so a :func:`~keyinit._bits.streams.register_stream` shows."""
    if name == "STREAM_VERSIONS":
        return streams.stream_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _resolve_stream(stream: Union[str, streams.Stream]) -> streams.Stream:
    """The registered stream version named ``stream`` (or ``stream`` itself, if it is a registered one)."""
    return streams.get_stream(stream.name if isinstance(stream, streams.Stream) else stream)


def _check_stream(stream: Union[str, streams.Stream]) -> str:
    """The name of a registered stream version (a :class:`keyinit._bits.streams.Stream` gives its name)."""
    return _resolve_stream(stream).name


@attrs.frozen(repr=False, order=True)
class Key:
    """An immutable PRNG key: two uint32 words and a stream version.

    Hashable and totally ordered (by words, then stream). Use :func:`key` to
    make one from a seed rather than constructing it directly.
    """

    k0: int = attrs.field(converter=_check_uint32)
    k1: int = attrs.field(converter=_check_uint32)
    stream: str = attrs.field(default=DEFAULT_STREAM, converter=_check_stream)  # a registered name

    @property
    def words(self) -> tuple[int, int]:
        """The two key words ``(k0, k1)`` as Philox uses them."""
        return (self.k0, self.k1)

    @property
    def impl(self) -> streams.Stream:
        """The registered :class:`keyinit._bits.streams.Stream` of this key's version (``self.stream`` is its name)."""
        return streams.get_stream(self.stream)

    def __repr__(self) -> str:
        return f"Key(0x{self.k0:08x}, 0x{self.k1:08x}, stream={self.stream!r})"


_new_object = object.__new__
_set_slot = object.__setattr__


def derived_key(k0: int, k1: int, stream: str) -> Key:
    """``Key(k0, k1, stream)`` without its checks, for keyinit's own derivations, whose words come from a
    derivation (ints in ``[0, 2**32)``) under the stream of an existing key (a registered name). Equal to
    the checked key in every way (it is one); anything else must call :class:`Key`."""
    made = _new_object(Key)
    _set_slot(made, "k0", k0)
    _set_slot(made, "k1", k1)
    _set_slot(made, "stream", stream)
    return made


def _is_bool(value: object) -> bool:
    """Python, numpy and torch booleans (refused wherever an int is expected)."""
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and str(dtype) in ("bool", "torch.bool")


def as_int(value: object, what: str) -> int:
    """``value`` as a Python int: ints and integer scalars (numpy ints, 0-d integer tensors) are
    accepted; bools, floats, strings and anything else raise ``TypeError`` naming ``what``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        if _is_bool(value) or isinstance(value, (float, str, bytes)):
            raise TypeError
        return operator.index(value)  # numpy integers, 0-d integer tensors
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def as_int_in(value: object, what: str, low: int, high: Optional[int] = None, expected: str = "") -> int:
    """``value`` as an int in ``[low, high)`` (``high`` None: no bound); the errors say
    ``"{what} must be {expected}, got ..."`` (``expected`` defaults to ``an int >= low``)."""
    expected = expected or f"an int >= {low}"
    try:
        value = as_int(value, what)
    except TypeError:
        raise TypeError(f"{what} must be {expected}, got {type(value).__name__} {value!r}") from None
    if value < low or (high is not None and value >= high):
        raise ValueError(f"{what} must be {expected}, got {value}")
    return value


def as_uint64(value: object, what: str) -> int:
    return as_int_in(value, what, 0, _UINT64_LIMIT, "an int in [0, 2**64)")


def key(seed: int, *, stream: str = DEFAULT_STREAM) -> Key:
    """The root key of ``seed`` in stream version ``stream``; in v1 its words are ``(lo32(seed), hi32(seed))``.

    ``seed`` is an int in ``[0, 2**64)``; bools, floats, strings and negative
    numbers are rejected.
    """
    seed = as_uint64(seed, "seed")
    impl = _resolve_stream(stream)
    k0, k1 = impl.seed(seed)
    return Key(k0, k1, impl.name)


def _derive(parent: Key, tag: int, x0: int, x1: int, x3: int) -> Key:
    k0, k1 = streams.get_stream(parent.stream).derive(parent.words, tag, (x0, x1, x3))
    return Key(k0, k1, parent.stream)


def require_key(value: object, what: str = "key") -> Key:
    if not isinstance(value, Key):
        raise TypeError(
            f"{what} must be a keyinit.Key (make one with keyinit.key(seed)), "
            f"got {type(value).__name__}"
        )
    return value


def split(parent: Key, num: int = 2) -> tuple[Key, ...]:
    """``num`` new keys derived from ``parent``.

    ``split(k, n)[i]`` does not depend on ``n``, so ``split(k, 3)[:2] == split(k, 2)``.
    """
    parent = require_key(parent)
    try:
        num = as_int(num, "num")
    except TypeError:
        raise ValueError(f"num must be a non-negative int, got {num!r}") from None
    if num < 0:
        raise ValueError(f"num must be a non-negative int, got {num!r}")
    return tuple(_derive(parent, _TAG_SPLIT, i & _MASK32, i >> 32, 0) for i in range(num))


def _string_words(data: str) -> tuple[int, int, int]:
    digest = hashlib.sha256(data.encode("utf-8")).digest()
    return tuple(int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(3))  # type: ignore[return-value]


def fold_in(parent: Key, data: Union[int, str]) -> Key:
    """A key derived from ``parent`` and ``data`` (an int in ``[0, 2**64)`` or a str).

    Strings are hashed with SHA-256 (never Python's salted ``hash``). Folding an
    int, folding a str and splitting are domain-separated, so ``fold_in(k, 1)``,
    ``fold_in(k, "1")`` and ``split(k)[1]`` are unrelated keys.
    """
    parent = require_key(parent)
    tag, (x0, x1, x3) = fold_inputs(data)
    return _derive(parent, tag, x0, x1, x3)


def fold_inputs(data: Union[int, str]) -> tuple[int, tuple[int, int, int]]:
    """``(tag, (x0, x1, x3))``: what ``fold_in(parent, data)`` passes to its stream's ``derive``
    (in stream v1, the Philox counter is ``(x0, x1, tag, x3)``; docs/spec.md section 3)."""
    if isinstance(data, str):
        return _TAG_FOLD_STR, _string_words(data)
    try:
        value = as_uint64(data, "fold_in data")
    except TypeError:
        raise TypeError(
            f"fold_in data must be an int in [0, 2**64) or a str, got {type(data).__name__} {data!r}"
        ) from None
    return _TAG_FOLD_INT, (value & _MASK32, value >> 32, 0)


def key_for(seed_or_key: Union[int, Key], fqn: str) -> Key:
    """The key of the parameter named ``fqn`` (a dot-separated path).

    Each dot-separated component is folded in, in order, as a string, so a
    subtree's keys depend only on its path and ``"a.bc"`` differs from ``"ab.c"``.
    """
    root = seed_or_key if isinstance(seed_or_key, Key) else key(seed_or_key)  # type: ignore[arg-type]
    if not isinstance(fqn, str):
        raise TypeError(f"fqn must be a str, got {type(fqn).__name__}")
    components = fqn.split(".")
    if not fqn or any(not part for part in components):
        raise ValueError(f"fqn must be non-empty dot-separated names, got {fqn!r}")
    derived = root
    for part in components:
        derived = fold_in(derived, part)
    return derived
