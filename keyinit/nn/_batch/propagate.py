"""Propagation of batch records through one ATen op: the op's rule (:mod:`keyinit.nn._batch.rules`), rows
picked by values (:mod:`keyinit.nn._batch.routed`), a forward of one row, tensors of unknown origin; and the same on
metadata only for a graph being traced.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from keyinit.nn._batch.records import FOREIGN, Batch, Foreign, Record, Unknown
from keyinit.nn._batch.rules import rule_for
from keyinit.nn._batch.routed import Routed, needs_values, proxied, routed_rule, unproxied

__all__ = ["propagate", "propagate_traced", "decomposed"]


def _one_sample(records: list[tuple[torch.Tensor, Record]]) -> Optional[Batch]:
    """``Batch(None, 1, s)`` when the inputs that hold a batch all hold the one sample ``s`` (a forward of one
    row) and none is unknown: whatever the op does with their elements, every element of its result is
    sample ``s``'s, at its row-major place, so a rule's layout conflict there mixes no samples (a reshape of
    one sample cannot tell which dimension its batch merged into, and ``einsum`` folds a size-1 batch
    dimension into the ones it contracts). Rows picked by values (:class:`Routed`) count as sample ``s``'s
    when every one of them is: a mixture of experts in a forward of one row, where top-k copies of its tokens
    (one sample's rows, a ``Batch`` of count 1) meet its routing weights picked in another order (routed)."""
    sample: Optional[int] = None
    for _, rec in records:
        if type(rec) is Routed:
            # rows picked by values from the one sample (a forward of one row): its rows, whatever their order
            with torch._C.DisableTorchFunction():
                found = rec.samples
                if found.numel() == 0 or not bool((found == found[0]).all()):
                    return None
                rec = Batch(rec.dim, 1, int(found[0]))
        if isinstance(rec, Unknown):
            return None
        if isinstance(rec, Batch):
            if rec.count != 1 or (sample is not None and rec.start != sample):
                return None
            sample = rec.start
    return None if sample is None else Batch(None, 1, sample)


_CACHE: dict[Any, Optional[Callable]] = {}
_DECOMPOSED: dict[Any, bool] = {}
_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd


def decomposed(func: Any) -> bool:
    """True for an op that has no batch rule and a ``CompositeImplicitAutograd`` kernel (``linear``, ``matmul``,
    ``layer_norm``, ``einsum``, ``conv2d``, ...): such ops reach a dispatch mode undecomposed only where autograd is
    off at the dispatcher (``torch.inference_mode``); the mode then runs the op's own decomposition, so its parts
    take their rules as they do under ``no_grad``."""
    try:
        return _DECOMPOSED[func]
    except KeyError:
        pass
    try:
        answer = rule_for(func) is None and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _IMPLICIT)
    except (AttributeError, RuntimeError):
        answer = False
    _DECOMPOSED[func] = answer
    return answer


def propagate(func: Any, args: tuple, kwargs: dict, out: Any, records: list[tuple[torch.Tensor, Record]]) -> list:
    """The records of ``out``'s tensors, flattened as :func:`torch.utils._pytree.tree_leaves` gives them.

    ``records`` are the ``(tensor, record)`` pairs of the op's tensor inputs, in order, at least one
    of them not replicated.
    """
    try:
        rule = _CACHE[func]
    except KeyError:
        rule = _CACHE[func] = rule_for(func)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    foreign = any(isinstance(r, Foreign) for _, r in records)
    if foreign:
        # a tensor of unknown origin holds no batch the rules can place: they see it as replicated, and a
        # result that holds no batch is then of unknown origin too (below)
        records = [(t, None if isinstance(r, Foreign) else r) for t, r in records]
        if all(r is None for _, r in records):
            return [FOREIGN] * len(outs)
    groups: list = []
    given = records
    if any(type(r) is Routed for _, r in records):
        # rows picked by values: the ops that read the values have their own rules; the others see each
        # routing as a batch of one-row samples (keyinit.nn._batch.routed)
        found = routed_rule(func, args, kwargs, records)
        if found is not None:
            return found + [found[-1]] * (len(outs) - len(found))
        records, groups = proxied(records)
    if rule is None:
        first = next((r for _, r in records if isinstance(r, Unknown)), None)
        return [first or Unknown(f"{func} (keyinit has no rule for where this op puts the batch)")] * len(outs)
    try:
        result = rule(func, args, kwargs, outs, records)
    except (IndexError, TypeError, ValueError, ZeroDivisionError) as exc:
        result = [Unknown(f"{func}: {exc}")] * len(outs)
    if len(result) < len(outs):
        result = result + [result[-1]] * (len(outs) - len(result))
    if any(type(r) is Unknown and not r.constant for r in result):
        sample = _one_sample(given)
        if sample is not None:
            result = [sample if type(r) is Unknown and not r.constant else r for r in result]
    if foreign:
        # a result computed from a tensor of unknown origin and no batch-holding tensor: of unknown origin too
        result = [FOREIGN if r is None else r for r in result]
    return unproxied(result, groups, func) if groups else result


def propagate_traced(func: Any, args: tuple, kwargs: dict, out: Any, records: list) -> list:
    """:func:`propagate` for an op of a graph being traced (:mod:`keyinit.nn._compiled.compile`), on its metadata only.

    A traced graph is replayed for any values, so a record may not rest on the values seen while
    tracing: the rules run on meta tensors of the same sizes, strides, offsets and dtypes. A rule that
    reads values (rows picked by index, :mod:`keyinit.nn._batch.routed`; an index that picks each sample's own
    rows) cannot: the graph then runs eagerly under keyed()'s modes (:mod:`keyinit.nn._compiled.compile`), where
    every call reads its own values. Called with the tracing modes off.
    """
    from torch.utils._pytree import tree_map

    stand_ins: dict = {}

    def meta(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        found = stand_ins.get(id(value))
        if found is None:
            size = value.untyped_storage().nbytes() // max(value.element_size(), 1)
            base = torch.empty(size, dtype=value.dtype, device="meta")
            found = stand_ins[id(value)] = base.as_strided(value.shape, value.stride(), value.storage_offset())
        return found

    if any(type(r) is Routed for _, r in records):  # rows picked by values in an eager part before the graph
        raise needs_values(f"the batch of {func}'s rows picked by values")
    try:
        with torch._C.DisableTorchFunction():
            return propagate(func, tree_map(meta, args), tree_map(meta, kwargs), tree_map(meta, out),
                             [(meta(t), r) for t, r in records])
    except (RuntimeError, NotImplementedError) as exc:
        # (the message _compile's trace takes for a graph that reads values: it runs eagerly)
        raise needs_values(f"the batch rule of {func}") from exc
