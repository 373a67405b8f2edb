"""A collated batch carrying its ``SamplePositions`` (where its rows sit in the run) from the sampler to ``keyed``.

:meth:`KeyedSampler.batch_sampler` yields lists of indices that carry it (``.keyinit_samples``);
``keyed_samples``' ``__getitems__`` passes it on in the :class:`KeyedBatch` it returns, and
``keyed_collate`` attaches it to the collated batch, so ``keyinit.nn.keyed(model, seed, step=step,
samples=batch)`` finds the step and the rows' first global sample with no arithmetic by the user.

The collated batch carries it as the attribute ``keyinit_samples``: set on the object the collate
function returned where it takes attributes (``BatchEncoding``, whose ``.to(device)`` returns itself;
a tensor; any object with a ``__dict__``), and for a plain ``dict``, ``list`` or ``tuple`` on a
subclass of it (:class:`SampleDict`, :class:`SampleList`, :class:`SampleTuple`: to any other code a
dict, list or tuple). A new dict made from it (``{k: v.to(device) for k, v in batch.items()}``) does
not carry it: pass ``samples=`` the batch the DataLoader gave.

The batch crosses processes (DataLoader workers) and copies (``pin_memory``) by pickling. Where its
class pickles only part of its state (``BatchEncoding``'s ``__getstate__`` keeps its data and
encodings), the batch's class becomes a subclass of it made here (:func:`carrier`, one per class, kept
in ``_CARRIERS``: the module's one registry) whose pickling is the class's own plus the positions. A
bare tensor returned by the collate function keeps them in the process that collated it only (torch's
worker queues rebuild tensors without their attributes): return a tuple, list or dict.

:class:`SamplePositions`, :func:`sample_positions` and :data:`ATTRIBUTE` are
:mod:`keyinit._samples.positions`' (``keyinit.nn.keyed`` reads them too), named here as well: a
``SamplePositions`` pickled under this module's name still loads. ``SampleDict``, ``SampleList`` and
``SampleTuple`` are defined here, under the name their pickles carry.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from keyinit._samples.positions import ATTRIBUTE, SamplePositions, sample_positions

__all__ = ["SamplePositions", "sample_positions", "attach", "SampleDict", "SampleList", "SampleTuple", "ATTRIBUTE"]


class SampleDict(dict):
    """A ``dict`` (what a collate function returned) that carries its rows' :class:`SamplePositions`."""


class SampleList(list):
    """A ``list`` (what a collate function returned) that carries its rows' :class:`SamplePositions`."""


class SampleTuple(tuple):
    """A ``tuple`` (what a collate function returned) that carries its rows' :class:`SamplePositions`."""


_WRAP = {dict: SampleDict, list: SampleList, tuple: SampleTuple}
#: class -> its carrier subclass (see :func:`carrier`).
_CARRIERS: dict[type, type] = {}
_PICKLING = ("__getstate__", "__reduce__", "__reduce_ex__")


def _rebuild(plain: Any, positions: SamplePositions) -> Any:
    """Unpickling a carrier: the object its class pickled, carrying ``positions`` again."""
    return attach(plain, positions)


def _reduce_carrier(self: Any, protocol: int) -> tuple:
    base = type(self).__bases__[0]
    plain = object.__new__(base)
    state = dict(object.__getattribute__(self, "__dict__"))
    positions = state.pop(ATTRIBUTE, None)
    object.__getattribute__(plain, "__dict__").update(state)
    return _rebuild, (plain, positions)


def carrier(cls: type) -> type:
    """The subclass of ``cls`` whose instances pickle and copy as ``cls``'s do, plus their positions."""
    found = _CARRIERS.get(cls)
    if found is None:
        found = type(cls.__name__, (cls,), {"__reduce_ex__": _reduce_carrier, "__module__": cls.__module__,
                                            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
        _CARRIERS[cls] = found
    return found


def _pickles_part(batch: Any) -> bool:
    """Whether ``batch``'s class replaces the default pickling, which keeps every attribute (a plain Python
    class that does: instances whose state is their ``__dict__``)."""
    cls = type(batch)
    if cls in _CARRIERS.values() or isinstance(batch, torch.Tensor) or cls.__flags__ & (1 << 9) == 0:
        return False  # (already one; a tensor; a class that is not a heap type)
    if cls.__new__ is not object.__new__ or not hasattr(batch, "__dict__"):
        return False  # (its state is not only its __dict__: left as it is)
    return any(getattr(cls, name, None) is not getattr(object, name) for name in _PICKLING)


def attach(batch: Any, positions: Optional[SamplePositions]) -> Any:
    """``batch`` carrying ``positions`` (see the module docstring); ``batch`` itself where it takes the attribute."""
    if positions is None:
        return batch
    wrap = _WRAP.get(type(batch))
    if wrap is not None:
        batch = wrap(batch)
    elif _pickles_part(batch):
        try:
            object.__setattr__(batch, "__class__", carrier(type(batch)))
        except TypeError:
            pass  # (a layout __class__ cannot change: it carries the positions in this process only)
    try:
        object.__setattr__(batch, ATTRIBUTE, positions)
    except (AttributeError, TypeError):
        pass  # (an object without a __dict__: it carries nothing; keyed(samples=) says so)
    return batch
