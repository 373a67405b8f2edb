"""Stream versions as registered objects, and the registry that a :class:`~keyinit.Key` resolves its version through.

A stream version (``docs/spec.md`` section 11) is one :class:`Stream`: its
name, how a seed becomes a root key, how a child key is derived and the word
function of its element streams. This is the model of JAX's ``PRNGImpl``
(``jax/_src/prng.py``): the math that depends on the version hangs off one
frozen object, so a new version (``"v2"``) is a new :class:`Stream` and one
:func:`register_stream` call, not a set of edits. Its kernel families (fills,
keyed dropout, keyed permutations: a reference and a kernel per device type)
are registered one floor up, in :mod:`keyinit._draw.dispatch`'s table.

A :class:`~keyinit.Key` keeps its version's *name* (``key.stream == "v1"``; keys
hash, order and pickle as before) and resolves it here (``key.impl``). The
registry, :data:`STREAMS`, is one of keyinit's documented global registries
(with the rule registry ``keyinit.REGISTRY`` and the kernel table of
:mod:`keyinit._draw.dispatch`): :func:`register_stream` adds a version and
refuses to replace one, since a released version never changes.
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from keyinit._bits.philox import philox4x32, stream_words

__all__ = ["Stream", "V1", "V2", "STREAMS", "register_stream", "get_stream", "stream_names", "derives_as_v1"]

_MASK32 = 0xFFFFFFFF

Words = tuple[int, int]


@attrs.frozen
class Stream:
    """A stream version: its math.

    - ``name``: what keys carry (``Key.stream``) and users pass (``key(seed, stream=...)``);
    - ``seed(seed) -> (k0, k1)``: the root key words of an int seed in ``[0, 2**64)``;
    - ``derive((k0, k1), tag, (x0, x1, x3)) -> (k0, k1)``: a child key's words
      (tags: 1 split, 2 fold_in of an int, 3 fold_in of a str);
    - ``words((k0, k1), element_index, words_per_element)``: the element stream,
      the words each element consumes (int64 tensors).

    Its kernel families are registered under ``name`` in :mod:`keyinit._draw.dispatch`.
    """

    name: str
    seed: Callable[[int], Words]
    derive: Callable[[Words, int, tuple[int, int, int]], Words]
    words: Callable[[Words, torch.Tensor, int], list[torch.Tensor]]

    def __repr__(self) -> str:
        return f"Stream({self.name!r})"


# ------------------------------------------------------------------ stream v1 (docs/spec.md)


def _v1_seed(seed: int) -> Words:
    """Section 2: ``(lo32(seed), hi32(seed))``."""
    return seed & _MASK32, seed >> 32


def _v1_derive(parent: Words, tag: int, data: tuple[int, int, int]) -> Words:
    """Section 3: ``Philox4x32-10((x0, x1, tag, x3), K)[0:2]``."""
    x0, x1, x3 = data
    out = philox4x32((x0, x1, tag, x3), parent)
    return out[0], out[1]


V1 = Stream(
    name="v1",
    seed=_v1_seed,
    derive=_v1_derive,
    words=stream_words,
)


# ------------------------------------------------------------------ stream v2 (docs/spec.md 14.8)

#: Stream v2: v1's seeds, derivation and element stream (sections 1-13 unchanged: every weight, data order
#: and collate value is v1's), with the extent-free names of keyed forwards (section 14.8) in place of
#: section 14.4-14.7's row-major indices (:mod:`keyinit._draw.names`).
V2 = Stream(
    name="v2",
    seed=_v1_seed,
    derive=_v1_derive,
    words=stream_words,
)


# ------------------------------------------------------------------ the registry

#: Every stream version this process can produce, by name: the documented registry.
STREAMS: dict[str, Stream] = {V1.name: V1, V2.name: V2}


def derives_as_v1(name: str) -> bool:
    """The stream version named ``name`` derives keys by section 3 (v1's ``derive``): the C derivation of the
    kernel library (``keyinit_derive``, checked against v1's when it loads) computes its keys too."""
    stream = STREAMS.get(name)
    return stream is not None and stream.derive is _v1_derive


def register_stream(stream: Stream) -> Stream:
    """Add ``stream`` to :data:`STREAMS` (returns it). A name already registered is refused: a
    released version never changes."""
    if not isinstance(stream, Stream):
        raise TypeError(f"register_stream takes a keyinit._bits.streams.Stream, got {type(stream).__name__}")
    if not isinstance(stream.name, str) or not stream.name:
        raise ValueError(f"a stream's name must be a non-empty str, got {stream.name!r}")
    if stream.name in STREAMS:
        raise ValueError(f"stream {stream.name!r} is already registered; a registered version never changes")
    STREAMS[stream.name] = stream
    return stream


def stream_names() -> tuple[str, ...]:
    """The names of the registered stream versions, in registration order."""
    return tuple(STREAMS)


def get_stream(name: str) -> Stream:
    """The registered stream called ``name``; ``ValueError`` if there is none."""
    stream = STREAMS.get(name) if isinstance(name, str) else None
    if stream is None:
        raise ValueError(f"unknown stream version {name!r}; this release supports {list(STREAMS)}")
    return stream
