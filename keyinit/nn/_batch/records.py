"""The model of the batch: which sample each element of an activation belongs to, tracked op by op.

:func:`keyinit.nn.keyed` keys a random op's output per sample. It does not guess
the batch from a shape: the model's inputs say where their batch is (dimension
0, or what :func:`batch_dim` declares), and every ATen op run in the keyed
forward carries that fact from its inputs to its outputs by a rule of the op
(views and reshapes, transposes, slicing, ``cat``/``split``, broadcasting
pointwise ops, matmuls, convolutions, norms, reductions, embeddings, ...).

:class:`Batch` describes one tensor: its dimension ``dim`` has size
``outer * count * inner``, and index ``i`` of that dimension belongs to local
sample ``(i // inner) % count``, global sample ``start + (i // inner) % count``.
So ``(B*H, L, S)`` attention scores are ``Batch(dim=0, count=B, inner=H)`` and
``(L*B, D)`` flattened sequence-first rows ``Batch(dim=0, count=B, inner=1)``
with ``outer = L``. ``dim = None`` means every element belongs to sample
``start`` (a selected row).

A tensor's record is kept by the root forward that made it (a weak map: it dies
with the tensor, and another forward does not see it). A tensor without a record
(a parameter, a buffer, a constant) holds no batch: it is *replicated*. An op
without a rule whose inputs hold a batch gives outputs whose batch is
*unknown* (rows picked by index values have a *routed* record,
:mod:`keyinit.nn._batch.routed`, an unknown that the ops it knows follow); a random op on such a tensor raises
:class:`~keyinit.errors.UnkeyedRandomnessError` rather than guess.

Sizes carry the fact too: inside a keyed forward, ``x.shape``/``x.size()`` of a
tensor whose batch dimension is exactly the batch (``outer = inner = 1``) give a
:class:`BatchSize` (an ``int``) there, so ``torch.rand(x.shape[0], L)`` and
``x.new_empty((x.shape[0], 1, 1))`` know their dimension 0 is the batch.
Arithmetic on a ``BatchSize`` gives a :class:`DerivedSize`: a factory sized by
it holds an unknown batch (``B * H`` does not say whether ``B`` is outer).

The rules of the ops (:mod:`keyinit.nn._batch.rules`) make records with :func:`merge`,
:func:`reshape` and :func:`sliced`, and read their op's arguments with :func:`arg`.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Optional, Sequence, Union

import attrs
import torch

__all__ = ["Batch", "Unknown", "Foreign", "FOREIGN", "BatchSize", "DerivedSize", "declare", "declared", "record",
           "annotate", "canonical", "same_for_every_sample", "arg"]


@attrs.frozen
class Batch:
    """Where the samples are in one tensor (see the module docstring)."""

    dim: Optional[int]
    count: int
    start: int
    inner: int = 1

    def moved(self, dim: Optional[int]) -> "Batch":
        return self if dim == self.dim else Batch(dim, self.count, self.start, self.inner)


@attrs.frozen
class Unknown:
    """A tensor computed from batch-holding inputs by an op keyinit has no rule for.

    ``constant``: a tensor of constant values (``torch.zeros(B * H, L)``) sized by arithmetic on the batch
    size: which of its elements are which sample's is unknown, but its values are the same for every
    sample, so combined with a batch-holding tensor it takes that tensor's layout (:func:`merge`).
    """

    why: str
    constant: bool = False


@attrs.frozen
class Foreign:
    """A tensor that entered the forward from outside: not an input, a parameter, a buffer or a tensor the
    forward computed (a forward hook's replacement output, a tensor held in a Python attribute)."""


FOREIGN = Foreign()
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
Record = Union[Batch, Unknown, Foreign, None]  # None: replicated (no batch)
_DECLARED = "_keyinit_batch_dim"


class BatchSize(int):
    """The size of a batch dimension (an ``int``), as ``x.shape`` gives it inside a keyed forward."""

    batch: Batch
    escaped: Optional[set]

    def __new__(cls, value: int, batch: Batch, escaped: Optional[set] = None) -> "BatchSize":
        self = super().__new__(cls, value)
        self.batch = batch
        self.escaped = escaped  # the forward's sizes that lost their tag (int(), len()): see keyinit.nn._forward.modes
        return self

    def __int__(self) -> int:
        value = int.__int__(self)
        if self.escaped is not None:  # int(x.shape[0]) drops the tag: a factory sized by it is refused
            self.escaped.add(value)
        return value

    def __repr__(self) -> str:
        return int.__repr__(self)

    def _derived(self, value: Any) -> Any:
        return DerivedSize(value) if isinstance(value, int) and not isinstance(value, bool) else value

    def __add__(self, other: Any) -> Any: return self._derived(int(self) + other) if isinstance(other, int) else NotImplemented
    def __radd__(self, other: Any) -> Any: return self.__add__(other)
    def __sub__(self, other: Any) -> Any: return self._derived(int(self) - other) if isinstance(other, int) else NotImplemented
    def __rsub__(self, other: Any) -> Any: return self._derived(other - int(self)) if isinstance(other, int) else NotImplemented
    def __mul__(self, other: Any) -> Any: return self._derived(int(self) * other) if isinstance(other, int) else NotImplemented
    def __rmul__(self, other: Any) -> Any: return self.__mul__(other)
    def __floordiv__(self, other: Any) -> Any: return self._derived(int(self) // other) if isinstance(other, int) else NotImplemented


class DerivedSize(BatchSize):
    """An ``int`` computed from a batch size: a factory sized by it holds an unknown batch."""

    def __new__(cls, value: int) -> "DerivedSize":  # type: ignore[override]
        self = int.__new__(cls, value)
        self.batch = None  # type: ignore[assignment]
        self.escaped = None
        return self


def declare(tensor: torch.Tensor, dim: Optional[int]) -> None:
    """Mark ``tensor`` as holding its samples in dimension ``dim`` (None: replicated)."""
    setattr(tensor, _DECLARED, ("declared", dim))


def declared(tensor: torch.Tensor) -> Any:
    """``("declared", dim)`` if :func:`batch_dim` was called on ``tensor``, else None."""
    return getattr(tensor, _DECLARED, None)


def record(tensor: Any, forward: Any) -> Record:
    """The batch record of ``tensor`` in ``forward`` (None: replicated)."""
    entry = forward.records.get(id(tensor))
    if entry is not None and entry[0]() is tensor:
        return entry[1]
    mark = getattr(tensor, _DECLARED, None)
    if mark is not None:  # declared with batch_dim before the forward: its rows are the forward's
        dim = mark[1]
        return None if dim is None else Batch(dim, int(tensor.shape[dim]), forward.start)
    if _wrapped(tensor):  # torch.func's wrappers (keyinit.nn._batch.functorch): the dispatch mode sees the values under
        return _wrapped_record(tensor, forward)
    local = getattr(tensor, "_local_tensor", None)
    if local is not None and local is not tensor:
        found = _dtensor_record(tensor, record(local, forward))
        if isinstance(found, Foreign) and tensor.dim():
            # a DTensor built outside the ops keyinit sees (tensor-parallel hooks, redistribute): its
            # GLOBAL dimension 0 is the batch, as docs/spec.md 14.4 states for DTensor activations
            return Batch(0, int(tensor.shape[0]), forward.start)
        return found
    if tensor.dim() == 0 or isinstance(tensor, torch.nn.Parameter) or id(tensor) in forward.constants:
        return None
    return FOREIGN


def _wrapped_record(tensor: Any, forward: Any) -> Record:
    """The record of a torch.func wrapper: its value's under grad levels; under a vmap level, whose samples are
    a dimension the wrapper hides, an unknown (keyinit.nn._forward.intercept keys element-wise dropout there on the
    physical tensor)."""
    from keyinit.nn._batch.functorch import describe, unwrapped, vmap_levels

    inner = unwrapped(tensor)
    if inner is not None:
        return record(inner, forward)
    physical, _ = vmap_levels(tensor)
    found = record(physical, forward)
    if found is None or isinstance(found, (Unknown, Foreign)):
        return found
    return Unknown(f"it is {describe(tensor)}, whose samples are the vmapped dimension that the function does not "
                   "see: under vmap keyinit keys element-wise dropout (nn.Dropout, F.dropout) and the random ATen "
                   "ops; call the model on the whole batch for this draw (or use torch.func.grad/vjp/functional_call "
                   "on the batch, which keep it)")


def _dtensor_record(tensor: Any, local: Record) -> Record:
    """A DTensor made from a local tensor (``DTensor.from_local``, tensor-parallel hooks): its local
    tensor's batch, when no placement shards the batch dimension (else the DTensor's rows are another
    rank's too)."""
    if not isinstance(local, Batch) or local.dim is None:
        return local
    from torch.distributed.tensor import Replicate

    for placement in tensor.placements:
        if not isinstance(placement, Replicate) and getattr(placement, "dim", None) == local.dim:
            return Unknown(f"a DTensor whose placements {tuple(tensor.placements)} shard its batch dimension "
                           f"{local.dim}")
    return local


def annotate(tensor: Any, forward: Any, value: Record) -> None:
    if isinstance(tensor, torch.Tensor):
        forward.records[id(tensor)] = (weakref.ref(tensor), value)
        if _wrapped(tensor):  # a torch.func grad wrapper: its value (which the dispatch mode sees) holds the same
            from keyinit.nn._batch.functorch import unwrapped

            inner = unwrapped(tensor)
            if inner is not None:
                forward.records[id(inner)] = (weakref.ref(inner), value)


# ----------------------------------------------------------------------------- rules



def arg(func: Any, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """Argument ``name`` of an ATen call, positional or keyword, or its schema default (read by the batch rules)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            if i < len(args) and not a.kwarg_only:
                return args[i]
            return kwargs.get(name, a.default_value if a.has_default_value() else default)
    return default


def merge(records: Sequence[tuple[Record, int, Optional[int]]], ndim: int, what: Any) -> Record:
    """The record of a broadcast result of ``ndim`` dims from ``(record, input ndim, size at its batch dim)``."""
    found: Record = None
    foreign = False
    constant: Optional[Unknown] = None
    single: Union[Batch, Unknown, None] = None
    for rec, in_ndim, size in records:
        if rec is None:
            continue
        if isinstance(rec, Unknown):
            if not rec.constant:
                return rec
            constant = constant or rec
            continue
        if isinstance(rec, Foreign):
            foreign = True
            continue
        if rec.dim is None:
            aligned: Batch = rec
        else:
            aligned = rec.moved(rec.dim + ndim - in_ndim)
            if size == 1 and rec.count == 1 and rec.inner == 1 and rec.start >= 0:
                # (a negative start: one row picked by values, keyinit.nn._batch.routed: never broadcast as a sample)
                # a batch of one: broadcast against the others' samples (the same values for each), or,
                # when no other input holds a batch, the one sample of a forward of one row
                single = aligned if single is None or single == aligned else Unknown(
                    f"{what} broadcasts rows of different samples ({single} and {aligned}) against each other")
                continue
        if found is None:
            found = aligned
        elif found != aligned:
            if _one_sample(found, aligned):
                found = found if found.inner == 1 and found.dim is not None else aligned
                continue
            return Unknown(f"{what} combines tensors whose batches are laid out differently ({found} and {aligned})")
    if found is None:
        return single or constant or (FOREIGN if foreign else None)
    if found.dim is None and found.count == 1 and isinstance(single, Batch) and single.start == found.start:
        # one sample's elements (a rule could not place them) with the same sample in a dimension: every
        # element is that sample's at its row-major place either way; keep the dimension (x.shape[0] stays
        # its batch size, as it is for a batch of more rows)
        return single
    return found


def _one_sample(a: Batch, b: Batch) -> bool:
    """Two records of the same one sample: every element of either is that sample's, at its row-major place,
    however the dimension is laid out (a forward of one row, where a reshape cannot tell which dimension
    the batch merged into), so combining them mixes no samples."""
    return a.count == 1 and b.count == 1 and a.start == b.start


def reshape(rec: Batch, old: Sequence[int], new: Sequence[int], what: Any) -> Record:
    """The record after a row-major reshape from ``old`` to ``new``."""
    if rec.dim is None:
        return rec
    if rec.count == 0 or math.prod(new) == 0:
        return Batch(None, rec.count, rec.start)
    period = rec.inner * math.prod(old[rec.dim + 1:])  # flat elements from one sample to the next
    block = period * rec.count  # one run through every local sample
    suffix = 1  # elements of the new dimensions after d
    fits: list[Batch] = []  # from the innermost dimension out
    for d in range(len(new) - 1, -1, -1):
        if suffix > period:
            break
        # dimension d holds the batch iff its stride divides the period and it spans whole runs
        if period % suffix == 0 and (new[d] * suffix) % block == 0:
            if rec.count != 1:
                return Batch(d, rec.count, rec.start, period // suffix)  # the one such dimension
            fits.append(Batch(d, 1, rec.start, period // suffix))
        suffix *= new[d]
    if fits:
        # One sample: each of these places it (all its elements are the sample's, in row-major order).
        # Keep it where a batch of more rows would be, so the ops after see the layout they see then: a
        # dimension of size 1 at the sample's stride (the same dimension as before if it is one, else the
        # outermost: (1, C) -> (1, 1, 1, C) keeps dimension 0, (L, D) -> (L, 1, D) takes dimension 1), else
        # the outermost (sequence-first (L, 1, D) -> (L, D): dimension 0, as (L*B, D) rows).
        ones = [b for b in fits if b.inner == 1 and new[b.dim] == 1]
        same = [b for b in ones if b.dim == rec.dim]
        return (same or ones or fits)[-1]
    return Unknown(f"{what} splits the batch dimension across dimensions ({tuple(old)} -> {tuple(new)})")


def sliced(rec: Batch, dim: int, size: int, start: int, end: int, step: int, what: Any) -> Record:
    if rec.dim != dim:
        return rec
    outer = size // (rec.count * rec.inner)
    start, end = max(0, min(start, size)), max(0, min(end, size))
    if outer == 1 and step == 1 and start % rec.inner == 0 and end % rec.inner == 0:
        return Batch(dim, max(0, end - start) // rec.inner, rec.start + start // rec.inner, rec.inner)
    if start == 0 and end >= size and step == 1:
        return rec
    return Unknown(f"{what} slices the batch dimension {dim} ([{start}:{end}:{step}] of {size})")


def same_for_every_sample(tensor: torch.Tensor, rec: Batch) -> bool:
    """Every sample's elements of ``tensor`` (batch ``rec``) equal the first sample's, in place: its values say
    nothing of which sample a row is (read on the values)."""
    if rec.dim is None or rec.count < 2 or tensor.is_floating_point() or tensor.is_complex():
        return False
    split, _, _ = canonical(tuple(tensor.shape), rec)
    with torch._C.DisableTorchFunction():
        parts = tensor.reshape(split)
        d = rec.dim + 1  # the count dimension of the split
        return bool(torch.equal(parts, parts.narrow(d, 0, 1).expand_as(parts)))


def canonical(shape: Sequence[int], rec: Batch) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(split, order, sample_shape)`` for a tensor of ``shape`` with batch ``rec``.

    ``tensor.reshape(split)`` separates the batch dimension into ``(outer, count,
    inner)``; ``permute(order)`` of that puts the samples first, followed by the
    element's index within its sample in row-major order of ``sample_shape``:
    the dimensions before the batch, ``outer``, ``inner``, the dimensions after.
    """
    shape = tuple(int(n) for n in shape)
    if rec.dim is None:
        return (1,) + shape, tuple(range(len(shape) + 1)), shape
    d = rec.dim
    outer = shape[d] // (rec.count * rec.inner)
    split = shape[:d] + (outer, rec.count, rec.inner) + shape[d + 1:]
    order = (d + 1,) + tuple(range(d + 1)) + tuple(range(d + 2, len(split)))
    sample_shape = shape[:d] + (outer, rec.inner) + shape[d + 1:]
    return split, order, sample_shape
