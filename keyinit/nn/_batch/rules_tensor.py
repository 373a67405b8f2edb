"""Batching rules of tensor ops: how views, shapes, joins, matmuls and reductions carry the batch.

The family of :mod:`keyinit.nn._batch.rules`'s table for ops that any tensor program uses ("add a
batching rule": one entry of :data:`RULES`, ``(rule, op names)``):

- views and copies that keep the shape (``clone``, ``_to_copy``, ``detach``, ...),
  element-wise ops torch does not tag ``pointwise`` and the ``*_like`` factories
  (:func:`pointwise`, also the table's fallback for ops tagged ``pointwise``): the
  inputs' batch, broadcast-aligned;
- reshapes (``view``, ``_unsafe_view``, ``reshape``): :func:`keyinit.nn._batch.records.reshape`;
- ``transpose``/``t``/``permute``, ``unsqueeze``/``squeeze``, ``expand``,
  ``select``/``slice``/``split``/``chunk``/``unbind``, ``cat``, ``index_select``,
  ``gather``, ``embedding``, ``constant_pad_nd``, ``flip``/``roll``, ``repeat``,
  ``view_as_real``/``view_as_complex``, the collectives along dimension 0;
- ``mm``/``addmm``/``bmm``/``baddbmm``, ``cumsum``/``sort``/``topk`` and the other ops
  along one dimension, reductions (a reduced batch dimension leaves a replicated result).

The kernels of neural networks, advanced indexing, the ops that write by index and
``as_strided`` are :mod:`keyinit.nn._batch.rules_nn`'s.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from keyinit.nn._batch.records import Batch, Record, Unknown, merge, reshape, same_for_every_sample, sliced
from keyinit.nn._batch.records import arg as _arg
from keyinit.nn._batch.routed import gathered_rows, picked

__all__ = ["RULES", "pointwise"]


def _dims(dims: Any, ndim: int) -> list[int]:
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({int(d) % ndim for d in dims}) if ndim else []


def _same(rec: Record, *_: Any) -> Record:
    return rec


def pointwise(func: Any, args: tuple, kwargs: dict, outs: list, records: list) -> list[Record]:
    """Every output broadcast from every tensor input."""
    inputs = [(rec, t.dim(), (int(t.shape[rec.dim]) if isinstance(rec, Batch) and rec.dim is not None else None))
              for t, rec in records]
    return [merge(inputs, o.dim(), func) if isinstance(o, torch.Tensor) else None for o in outs]


def _first(records: list) -> tuple[torch.Tensor, Record]:
    return records[0]


def _permuted(rec: Record, order: Sequence[int]) -> Record:
    if not isinstance(rec, Batch) or rec.dim is None:
        return rec
    return rec.moved(list(order).index(rec.dim))


def _removed(rec: Record, removed: Sequence[int], keepdim: bool) -> Record:
    """After a reduction over ``removed`` dims."""
    if not isinstance(rec, Batch) or rec.dim is None:
        return rec
    if rec.dim in removed:
        return None  # the batch is reduced: the result is the same for every sample
    if keepdim:
        return rec
    return rec.moved(rec.dim - sum(1 for d in removed if d < rec.dim))


def _rule_view(func, args, kwargs, outs, records):
    t, rec = records[0]
    if not isinstance(rec, Batch):
        return [rec]
    return [reshape(rec, tuple(t.shape), tuple(outs[0].shape), func)]


def _rule_transpose(func, args, kwargs, outs, records):
    t, rec = records[0]
    n = t.dim()
    name = func._schema.name
    if name in ("aten::t", "aten::numpy_T"):
        order = list(range(n))[::-1]
    elif name == "aten::permute":
        order = [int(d) % n for d in args[1]]
    else:
        d0, d1 = int(args[1]) % max(n, 1), int(args[2]) % max(n, 1)
        order = list(range(n))
        order[d0], order[d1] = order[d1], order[d0]
    return [_permuted(rec, order)]


def _rule_unsqueeze(func, args, kwargs, outs, records):
    t, rec = records[0]
    if not isinstance(rec, Batch) or rec.dim is None:
        return [rec]
    d = int(args[1]) % (t.dim() + 1)
    return [rec.moved(rec.dim + 1 if d <= rec.dim else rec.dim)]


def _rule_squeeze(func, args, kwargs, outs, records):
    t, rec = records[0]
    if not isinstance(rec, Batch) or rec.dim is None:
        return [rec]
    dims = [d for d in _dims(args[1] if len(args) > 1 else None, t.dim()) if t.shape[d] == 1]
    if rec.dim in dims:
        return [rec.moved(None)]  # one element along the batch: all of it one sample
    return [rec.moved(rec.dim - sum(1 for d in dims if d < rec.dim))]


def _rule_expand(func, args, kwargs, outs, records):
    t, rec = records[0]
    if not isinstance(rec, Batch) or rec.dim is None:
        return [rec]
    return [rec.moved(rec.dim + outs[0].dim() - t.dim())]


def _rule_select(func, args, kwargs, outs, records):
    t, rec = records[0]
    if not isinstance(rec, Batch) or rec.dim is None:
        return [rec]
    dim = int(args[1]) % t.dim()
    if dim != rec.dim:
        return [rec.moved(rec.dim - (1 if dim < rec.dim else 0))]
    size = int(t.shape[dim])
    if size == rec.count and rec.inner == 1:
        index = int(args[2]) % size
        return [Batch(None, 1, rec.start + index)]
    return [Unknown(f"{func} selects one index of the merged batch dimension {dim}")]


def _rule_slice(func, args, kwargs, outs, records):
    t, rec = records[0]
    if not isinstance(rec, Batch) or rec.dim is None:
        return [rec]
    dim = int(_arg(func, args, kwargs, "dim", 0)) % t.dim()
    size = int(t.shape[dim])
    start = _arg(func, args, kwargs, "start", None)
    end = _arg(func, args, kwargs, "end", None)
    step = int(_arg(func, args, kwargs, "step", 1))
    start = 0 if start is None else int(start)
    end = size if end is None else int(end)
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    return [sliced(rec, dim, size, start, end, step, func)]


def _rule_split(func, args, kwargs, outs, records):
    t, rec = records[0]
    pieces = outs
    if not isinstance(rec, Batch) or rec.dim is None:
        return [rec] * len(pieces)
    name = func._schema.name
    dim = int(_arg(func, args, kwargs, "dim", 0)) % t.dim()
    if name == "aten::unbind":
        if dim != rec.dim:
            return [rec.moved(rec.dim - (1 if dim < rec.dim else 0))] * len(pieces)
        if rec.inner == 1 and int(t.shape[dim]) == rec.count:
            return [Batch(None, 1, rec.start + i) for i in range(len(pieces))]
        return [Unknown(f"{func} of the merged batch dimension")] * len(pieces)
    result, offset, size = [], 0, int(t.shape[dim])
    for piece in pieces:
        n = int(piece.shape[dim])
        result.append(sliced(rec, dim, size, offset, offset + n, 1, func))
        offset += n
    return result


def _rule_cat(func, args, kwargs, outs, records):
    tensors = args[0]
    dim = int(_arg(func, args, kwargs, "dim", 0))
    recs = []
    for t in tensors:
        rec = next((r for tt, r in records if tt is t), None)
        recs.append((t, rec))
    nd = outs[0].dim()
    dim %= max(nd, 1)
    live = [(t, r) for t, r in recs if not (t.dim() == 1 and t.numel() == 0)]
    if any(isinstance(r, Unknown) for _, r in live):
        return [next(r for _, r in live if isinstance(r, Unknown))]
    batches = [r for _, r in live if isinstance(r, Batch)]
    if not batches:
        return [None]
    if all(r.dim is not None and r.dim != dim for r in batches):
        # joined along another dimension: position b of the batch dimension is sample b in every piece
        # (a replicated piece, such as an expanded class token, holds the same values for each sample)
        first = batches[0]
        if all(r == first for r in batches):
            return [first]
    if all(isinstance(r, Batch) and r.dim == dim and r.inner == 1 for _, r in live):
        # samples concatenated in order: one run of consecutive samples
        start, expect, ok = live[0][1].start, live[0][1].start, True
        for t, r in live:
            ok = ok and r.start == expect and int(t.shape[dim]) == r.count
            expect += r.count
        if ok:
            return [Batch(dim, expect - start, start)]
    return [Unknown(f"{func} joins tensors along dimension {dim} whose batches do not line up")]


def _rule_index_select(func, args, kwargs, outs, records):
    t, rec = records[0]
    if not isinstance(rec, Batch) or rec.dim is None:
        return [rec]
    dim = int(args[1]) % t.dim()
    if dim == rec.dim:
        return [picked(rec, int(t.shape[dim]), dim, args[2])]  # rows by the index's values (keyinit.nn._batch.routed)
    return [rec]


def _rule_gather(func, args, kwargs, outs, records):
    t, rec = records[0]
    index = args[2]
    irec = next((r for tt, r in records if tt is index), None)
    dim = int(args[1]) % max(t.dim(), 1)
    if isinstance(rec, Batch) and rec.dim == dim:
        return [gathered_rows(rec, t, dim, index)]  # rows picked by values (keyinit.nn._batch.routed), or unknown
    own = (rec, t.dim(), None if not isinstance(rec, Batch) or rec.dim is None else int(t.shape[rec.dim]))
    found = merge([own, (irec, index.dim(), None)], outs[0].dim(), func)
    if type(found) is Unknown and isinstance(irec, Batch) and same_for_every_sample(index, irec):
        # an index whose values are every sample's (relative position buckets repeated per sample and head,
        # ProphetNet): it picks the same positions in each row, whichever sample its own rows are laid out as
        found = merge([own], outs[0].dim(), func)
    return [found]


def _rule_embedding(func, args, kwargs, outs, records):
    indices = args[1]
    rec = next((r for tt, r in records if tt is indices), None)
    return [rec]  # (*indices.shape, D): the indices' dimensions first


def _rule_mm(func, args, kwargs, outs, records):
    name = func._schema.name
    if name in ("aten::addmm", "aten::baddbmm", "aten::addbmm"):
        bias, a, b = args[0], args[1], args[2]
    else:
        bias, a, b = None, args[0], args[1]
    rec = {id(t): r for t, r in records}
    ra, rb = rec.get(id(a)), rec.get(id(b))
    nd = outs[0].dim()
    cands: list[tuple[Record, int, Optional[int]]] = []
    if isinstance(ra, Unknown) or isinstance(rb, Unknown):
        return [ra if isinstance(ra, Unknown) else rb]
    if isinstance(ra, Batch):
        if ra.dim is not None and ra.dim == a.dim() - 1:
            return [Unknown(f"{func} contracts the batch dimension of its first operand")]
        cands.append((ra, nd, None))  # a's leading dims (and rows) are the output's
    if isinstance(rb, Batch):
        if rb.dim is not None and rb.dim == b.dim() - 2:
            return [Unknown(f"{func} contracts the batch dimension of its second operand")]
        cands.append((rb, nd, None))
    if bias is not None:
        rbias = rec.get(id(bias))
        cands.append((rbias, bias.dim(), None if not isinstance(rbias, Batch) or rbias.dim is None
                      else int(bias.shape[rbias.dim])))
    return [merge(cands, nd, func)]


def _rule_reduce(func, args, kwargs, outs, records):
    t, rec = records[0]
    nd = t.dim()
    dims = _arg(func, args, kwargs, "dim", None)
    keepdim = bool(_arg(func, args, kwargs, "keepdim", False))
    if dims is None and func._schema.name in ("aten::sum", "aten::mean", "aten::amax", "aten::amin", "aten::prod",
                                              "aten::any", "aten::all", "aten::max", "aten::min", "aten::std",
                                              "aten::var", "aten::norm", "aten::linalg_vector_norm", "aten::argmax",
                                              "aten::argmin", "aten::count_nonzero", "aten::logsumexp"):
        removed = list(range(nd))
    else:
        removed = _dims(dims, nd) if dims is not None and (not isinstance(dims, (list, tuple)) or len(dims)) else list(range(nd))
    out = _removed(rec, removed, keepdim)
    return [out if isinstance(o, torch.Tensor) else None for o in outs]


def _rule_along(func, args, kwargs, outs, records):
    """Ops along one dim that keep the shape (softmax, cumsum, sort, topk, ...): positions kept unless
    the op reorders the batch dimension."""
    t, rec = records[0]
    dim = _arg(func, args, kwargs, "dim", -1)
    name = func._schema.name
    if isinstance(rec, Batch) and rec.dim is not None and t.dim() and int(dim) % t.dim() == rec.dim and \
            name in ("aten::sort", "aten::topk", "aten::argsort", "aten::kthvalue"):
        indices = outs[0] if name == "aten::argsort" else outs[1] if name != "aten::kthvalue" else None
        if indices is not None and all(int(n) == 1 for d, n in enumerate(t.shape) if d != rec.dim):
            # one row per position along the batch dimension, put in order by their values: rows picked by the
            # indices output's values (keyinit.nn._batch.routed), the values and the indices alike
            found = picked(rec, int(t.shape[rec.dim]), rec.dim, indices)
            return [found if isinstance(o, torch.Tensor) else None for o in outs]
        return [Unknown(f"{func} reorders the batch dimension")] * len(outs)
    return [rec if isinstance(o, torch.Tensor) else None for o in outs]


def _rule_pad(func, args, kwargs, outs, records):
    t, rec = records[0]
    if not isinstance(rec, Batch) or rec.dim is None:
        return [rec]
    pad = list(args[1])
    padded = {t.dim() - 1 - i // 2 for i, v in enumerate(pad) if v}
    if rec.dim in padded:
        return [Unknown(f"{func} pads the batch dimension")]
    return [rec]


def _rule_flip(func, args, kwargs, outs, records):
    t, rec = records[0]
    if not isinstance(rec, Batch) or rec.dim is None:
        return [rec]
    dims = _dims(args[1] if len(args) > 1 else kwargs.get("dims"), t.dim())
    if func._schema.name == "aten::roll" and len(args) < 3 and "dims" not in kwargs:
        dims = list(range(t.dim()))  # roll without dims flattens
    if rec.dim in dims:
        return [Unknown(f"{func} moves elements along the batch dimension")]
    return [rec]


def _rule_repeat(func, args, kwargs, outs, records):
    t, rec = records[0]
    if not isinstance(rec, Batch) or rec.dim is None:
        return [rec]
    # repeat tiles: index i of the batch dimension (size outer*count*inner) holds the element at
    # i % size, whose sample (i // inner) % count is unchanged; only outer grows
    extra = len(list(args[1])) - t.dim()
    return [rec.moved(rec.dim + extra)]


def _rule_complex_view(func, args, kwargs, outs, records):
    """``view_as_real`` adds a trailing dimension of 2 (real, imaginary); ``view_as_complex`` removes it:
    the other dimensions keep their places."""
    t, rec = records[0]
    if isinstance(rec, Batch) and rec.dim is not None and rec.dim == t.dim() - 1 and \
            func._schema.name == "aten::view_as_complex":
        return [Unknown(f"{func} joins pairs of the batch dimension")]
    return [rec]


def _rule_collective_dim0(func, args, kwargs, outs, records):
    """all_gather / reduce_scatter along dimension 0: other ranks' rows join or leave dimension 0."""
    t, rec = records[0]
    if isinstance(rec, Batch) and rec.dim == 0:
        return [Unknown(f"{func} exchanges rows of the batch dimension with other ranks")]
    return [rec]




#: ``(rule, op names)``: the family's entries of :mod:`keyinit.nn._batch.rules`'s table (each op named once in
#: all of the families).
RULES = (
    (_rule_view, (
        "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::view_copy", "aten::_reshape_copy",
        "aten::flatten", "aten::unflatten", "aten::_reshape_alias")),
    (_rule_transpose, (
        "aten::t", "aten::transpose", "aten::permute", "aten::numpy_T", "aten::swapaxes", "aten::transpose_")),
    (_rule_unsqueeze, ("aten::unsqueeze", "aten::unsqueeze_")),
    (_rule_squeeze, ("aten::squeeze", "aten::squeeze_")),
    (_rule_expand, ("aten::expand", "aten::expand_copy")),
    (_rule_select, ("aten::select",)),
    (_rule_slice, ("aten::slice", "aten::narrow")),
    (_rule_split, (
        "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::chunk", "aten::tensor_split",
        "aten::unsafe_split", "aten::unsafe_split_with_sizes", "aten::split_copy")),
    (_rule_cat, ("aten::cat",)),
    (_rule_index_select, ("aten::index_select",)),
    (_rule_gather, ("aten::gather",)),
    (_rule_embedding, ("aten::embedding",)),
    (_rule_mm, ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    (_rule_reduce, (
        "aten::sum", "aten::mean", "aten::amax", "aten::amin", "aten::prod", "aten::any", "aten::all", "aten::max",
        "aten::min", "aten::std", "aten::var", "aten::var_mean", "aten::std_mean", "aten::norm",
        "aten::linalg_vector_norm", "aten::argmax", "aten::argmin", "aten::logsumexp", "aten::count_nonzero",
        "aten::median", "aten::nanmedian", "aten::mode", "aten::nansum", "aten::nanmean", "aten::kthvalue")),
    (_rule_along, (
        "aten::cumsum", "aten::cumprod", "aten::sort", "aten::topk", "aten::argsort", "aten::cummax",
        "aten::cummin", "aten::logcumsumexp", "aten::_safe_softmax")),
    (_rule_pad, ("aten::constant_pad_nd",)),
    (_rule_flip, ("aten::flip", "aten::roll")),
    (_rule_repeat, ("aten::repeat",)),
    (_rule_collective_dim0, (
        "_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor")),
    (_rule_complex_view, ("aten::view_as_real", "aten::view_as_complex")),
    # element-wise ops torch does not tag pointwise (floor_divide, log_sigmoid_backward, ...), copies,
    # softmaxes and dropouts (every position kept), the *_like factories, in-place fills and draws, collectives
    # that keep every position
    (pointwise, (
        "_c10d_functional::all_reduce", "_c10d_functional::wait_tensor", "_c10d_functional::broadcast",
        "_c10d_functional::all_reduce_", "_c10d_functional::broadcast_", "_c10d_functional::_wrap_tensor_autograd",
        "aten::clone", "aten::_to_copy", "aten::detach", "aten::alias", "aten::lift_fresh", "aten::contiguous",
        "aten::_softmax", "aten::_log_softmax", "aten::softmax", "aten::log_softmax", "aten::native_dropout",
        "aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::rand_like",
        "aten::randn_like", "aten::randint_like", "aten::fill", "aten::fill_", "aten::zero_", "aten::masked_fill",
        "aten::masked_fill_", "aten::_conj", "aten::resolve_conj", "aten::resolve_neg", "aten::copy",
        "aten::copy_", "aten::dropout", "aten::feature_dropout", "aten::alpha_dropout", "aten::_masked_softmax",
        "aten::tril", "aten::triu", "aten::tril_", "aten::triu_", "aten::_softmax_backward_data",
        "aten::nan_to_num", "aten::uniform_", "aten::normal_", "aten::bernoulli_", "aten::exponential_",
        "aten::geometric_", "aten::cauchy_", "aten::log_normal_", "aten::random_", "aten::set_",
        "aten::floor_divide", "aten::floor_divide_", "aten::log_sigmoid_backward")),
)
