"""``SampleIndex``: an ``int`` that carries its epoch, what :class:`KeyedSampler` yields by default.

It is an ``int`` everywhere an int is expected (``list[i]``, ``tensor[i]``, ``range`` checks, equality,
hashing, arithmetic, which gives plain ints), so a plain dataset and ``DataLoader`` code written for
``SequentialSampler`` work unchanged; :func:`keyinit.data.keyed_samples` and
:func:`keyinit.data.keyed_collate` read ``index.epoch``.

Each epoch has its own subclass (made once per process and kept in a bounded cache), whose ``epoch``
is a class attribute: building an index (``map(cls, indices)``) runs no Python code, though an int
subclass still costs several times a plain int to allocate (``KeyedSampler(yield_epoch=False)``
yields plain ints for plain datasets). Pickling (DataLoader worker queues) refers to the epoch's
class by name (``keyinit.data._index._SampleIndex_<epoch>``, which the module makes on demand), so
another process rebuilds the same value.
"""

from __future__ import annotations

import functools
from typing import ClassVar

from keyinit.keys import as_int_in

__all__ = ["SampleIndex", "sample_index", "epoch_of"]


class SampleIndex(int):
    """Sample ``int(self)`` of epoch ``self.epoch``. Make one with :func:`sample_index`."""

    __slots__ = ()
    epoch: ClassVar[int]

    # Pickled by the default protocol-2 reduction (in C): the epoch's class by reference (module
    # attribute _SampleIndex_<epoch>, made on demand by the module's __getattr__ where it is unpickled)
    # and int's own __getnewargs__.

    def __repr__(self) -> str:
        return f"sample_index({int(self)}, epoch={self.epoch})"


_PREFIX = "_SampleIndex_"


@functools.lru_cache(maxsize=1024)
def _epoch_class(epoch: int) -> type:
    name = f"{_PREFIX}{epoch}"
    return type(name, (SampleIndex,), {"__slots__": (), "epoch": epoch, "__module__": __name__,
                                       "__qualname__": name})


def __getattr__(name: str) -> type:
    """``_SampleIndex_<epoch>``: the epoch's class, for unpickling (PEP 562; made on demand)."""
    if name.startswith(_PREFIX) and name[len(_PREFIX):].isdigit():
        return _epoch_class(int(name[len(_PREFIX):]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _sample_index(index: int, epoch: int) -> SampleIndex:
    return _epoch_class(epoch)(index)


def sample_index(index: int, epoch: int) -> SampleIndex:
    """Sample ``index`` of epoch ``epoch`` as an int that carries the epoch (both ints >= 0)."""
    values = [as_int_in(value, f"sample_index: {what}", 0) for value, what in ((index, "index"), (epoch, "epoch"))]
    return _sample_index(values[0], values[1])


def epoch_class(epoch: int) -> type:
    """The :class:`SampleIndex` subclass of ``epoch`` (``cls(i)`` is ``sample_index(i, epoch)``)."""
    return _epoch_class(int(epoch))


def epoch_of(index: object) -> "int | None":
    """The epoch an index carries (:class:`SampleIndex`), else None."""
    return index.epoch if isinstance(index, SampleIndex) else None
