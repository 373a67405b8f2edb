"""Stream versions as registered objects, and the registry that a :class:`~keyinit.Key` resolves its version through.

A stream version (``docs/spec.md`` section 11) is one :class:`Stream`: its
name, how a seed becomes a root key, how a child key is derived, the word
function of its element streams, and the implementations of its kernel
families (fills, keyed dropout, keyed permutations), each a reference plus a
kernel per device type. This is the model of JAX's ``PRNGImpl``
(``jax/_src/prng.py``): everything that depends on the version hangs off one
frozen object, so a new version (``"v2"``) is a new :class:`Stream` and one
:func:`register_stream` call, not a set of edits.

A :class:`~keyinit.Key` keeps its version's *name* (``key.stream == "v1"``; keys
hash, order and pickle as before) and resolves it here (``key.impl``). The
registry, :data:`STREAMS`, is keyinit's only global mutable state besides the
rule registry (``keyinit.REGISTRY``): :func:`register_stream` adds a version
and refuses to replace one, since a released version never changes.

Implementations are named by module and function (:class:`KernelRef`) and
imported on first use: defining or resolving a stream imports no kernel, no
C compiler runs and nothing is registered with torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable, Optional

import attrs
import torch

from keyinit._bits.philox import philox4x32, stream_words

__all__ = ["KernelRef", "Kernels", "Stream", "V1", "STREAMS", "register_stream", "get_stream", "stream_names"]

_MASK32 = 0xFFFFFFFF

Words = tuple[int, int]


@attrs.frozen
class KernelRef:
    """An implementation named by ``module`` and ``name``, imported when first resolved.

    Resolved at every call (a dictionary lookup once the module is imported), so
    an implementation replaced on its module (a test's ``monkeypatch``) is the one
    that runs.
    """

    module: str
    name: str

    def resolve(self) -> Optional[Callable[..., Any]]:
        """The function, or ``None`` when its module cannot be imported (e.g. no ``triton``)."""
        module = sys.modules.get(self.module)
        if module is None:
            try:
                module = importlib.import_module(self.module)
            except Exception:  # noqa: BLE001 - a kernel that cannot even be imported is unavailable
                return None
        return getattr(module, self.name)


def _read_only(devices: Mapping[str, KernelRef]) -> Mapping[str, KernelRef]:
    return MappingProxyType(dict(devices))


def _kernels_disabled() -> bool:
    from keyinit._kernels import kernels_disabled

    return kernels_disabled()


@attrs.frozen
class Kernels:
    """One kernel family of a stream: the ``reference`` (any device) and a kernel per device type.

    All take the same arguments. A kernel returns ``True`` when it wrote the
    result and ``False`` when it cannot (nothing written; the reference runs);
    the reference always writes it.
    """

    reference: KernelRef
    devices: Mapping[str, KernelRef] = attrs.field(converter=_read_only)

    def run(self, device: str, *args: Any, **kwargs: Any) -> None:
        """The kernel for ``device`` unless kernels are disabled (``KEYINIT_DISABLE_KERNELS``) or it
        declines, else the reference."""
        if not _kernels_disabled():
            ref = self.devices.get(device)
            kernel = ref.resolve() if ref is not None else None
            if kernel is not None and kernel(*args, **kwargs):
                return
        reference = self.reference.resolve()
        if reference is None:  # pragma: no cover - the references import nothing optional
            raise ImportError(f"the reference {self.reference.module}.{self.reference.name} cannot be imported")
        reference(*args, **kwargs)


@attrs.frozen
class Stream:
    """A stream version: everything that depends on it.

    - ``name``: what keys carry (``Key.stream``) and users pass (``key(seed, stream=...)``);
    - ``seed(seed) -> (k0, k1)``: the root key words of an int seed in ``[0, 2**64)``;
    - ``derive((k0, k1), tag, (x0, x1, x3)) -> (k0, k1)``: a child key's words
      (tags: 1 split, 2 fold_in of an int, 3 fold_in of a str);
    - ``words((k0, k1), element_index, words_per_element)``: the element stream,
      the words each element consumes (int64 tensors);
    - ``fill``, ``dropout``, ``permutation``: the kernel families that
      :mod:`keyinit._draw.dispatch` runs for keys of this stream.
    """

    name: str
    seed: Callable[[int], Words]
    derive: Callable[[Words, int, tuple[int, int, int]], Words]
    words: Callable[[Words, torch.Tensor, int], list[torch.Tensor]]
    fill: Kernels
    dropout: Kernels
    permutation: Kernels

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
    fill=Kernels(KernelRef("keyinit._draw.reference_fill", "fill"), {
        "cpu": KernelRef("keyinit._kernels._cpu", "fill"),
        "cuda": KernelRef("keyinit._kernels.triton_kernel", "fill"),
    }),
    dropout=Kernels(KernelRef("keyinit._draw.reference_dropout", "dropout"), {
        "cpu": KernelRef("keyinit._kernels._dropout_cpu", "run"),
        "cuda": KernelRef("keyinit._kernels.triton_dropout", "run"),
    }),
    permutation=Kernels(KernelRef("keyinit._draw.reference_permutation", "permute_into"), {
        "cpu": KernelRef("keyinit._kernels._permutation_cpu", "run"),
        "cuda": KernelRef("keyinit._kernels.triton_permutation", "run"),
    }),
)


# ------------------------------------------------------------------ the registry

#: Every stream version this process can produce, by name: the documented registry.
STREAMS: dict[str, Stream] = {V1.name: V1}


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
