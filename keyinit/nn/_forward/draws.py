"""Keyed values of a random ATen op run inside a keyed forward: per sample, or replicated.

The op's values are the engine's (:func:`keyinit._engine.keyed.keyed_op.keyed_op`: the op's keyed
equivalent of ``docs/spec.md`` section 15); only the stream positions are the forward's
(``docs/spec.md`` section 14.7):

- **replicated** (the output holds no batch): the output's row-major index, as
  for a tensor of the output's shape;
- **per sample** (the output's batch is known, :mod:`keyinit.nn._batch.records`): the
  element's row-major index in the tensor ``(start + count, *sample_shape)``
  whose row ``s`` is global sample ``s``, so each element's value depends only on
  its sample and its place within it (:func:`keyinit.nn._batch.records.canonical`).

- **routed rows** (:mod:`keyinit.nn._batch.routed`: rows picked from the batch by values): the index of the
  same element of the *virtual* tensor, the rows in their place in the batch (:func:`routed_rows`).

Ops whose output is one joint draw over its rows (``randperm`` sized by the batch)
cannot be split by sample: on a per-sample output they are refused.
"""

from __future__ import annotations

from typing import Any

from keyinit._engine.keyed.keyed_op import Rows, keyed_op
from keyinit.keys import Key
from keyinit.nn._batch.records import Batch, canonical

__all__ = ["keyed_draw"]


def sample_rows(shape: tuple[int, ...], batch: Batch) -> Rows:
    """The :class:`keyinit._engine.keyed.keyed_op.Rows` of a tensor of ``shape`` whose batch is ``batch``."""
    split, order, sample_shape = canonical(shape, batch)
    local = (batch.count,) + sample_shape
    inverse = [order.index(i) for i in range(len(order))]
    permuted = tuple(split[i] for i in order)
    return Rows(batch.start, batch.count, shape, local,
                lambda t: t.reshape(split).permute(order).reshape(local),
                lambda t: t.reshape(permuted).permute(inverse).reshape(shape), batch.dim)


def routed_rows(shape: tuple[int, ...], rec: Any) -> Rows:
    """The :class:`Rows` of a tensor of ``shape`` whose dimension ``rec.dim`` holds rows picked from the batch
    by values (a :class:`keyinit.nn._batch.routed.Routed` whose rows are known, each picked once): those of the
    *virtual* tensor, the rows in their place in the batch, drawn whole and read at the rows."""
    d = rec.dim
    vshape = tuple(shape[:d]) + (rec.size,) + tuple(shape[d + 1:])
    virtual = sample_rows(vshape, Batch(d, rec.count, rec.start, rec.inner))
    rows = rec.rows

    def to_canonical(t):
        full = t.new_zeros(vshape)
        return virtual.to_canonical(full.index_copy_(d, rows.to(t.device), t))

    def from_canonical(t):
        return virtual.from_canonical(t).index_select(d, rows.to(t.device))

    return Rows(rec.start, rec.count, tuple(shape), virtual.local, to_canonical, from_canonical, d)


def keyed_draw(func: Any, args: tuple, kwargs: dict, key: Key, batch: Any, site: str) -> Any:
    """``func(*args, **kwargs)`` (a random ATen op) with keyinit's values for ``key``; ``batch`` is the
    output's batch (None: replicated; a :class:`keyinit.nn._batch.routed.Routed`: rows picked by values, as the
    virtual tensor's). In-place ops write their argument and return it."""
    from keyinit.nn._batch.routed import Routed

    if type(batch) is Routed:
        return keyed_op(func, args, kwargs, key, site, "the keyed forward", lambda shape: routed_rows(shape, batch))
    rows_of = None if batch is None else (lambda shape: sample_rows(shape, batch))
    return keyed_op(func, args, kwargs, key, site, "the keyed forward", rows_of)
