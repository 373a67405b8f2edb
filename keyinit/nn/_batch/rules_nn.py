"""Batching rules of neural-network kernels, indexing and strides: where the batch goes through them.

The family of :mod:`keyinit.nn._batch.rules`'s table for convolutions, norms, pooling and
resampling, fused attention, ``stack``, advanced indexing, the ops that write by index,
FFTs, ``as_strided`` and a few others ("add a batching rule": one entry of :data:`RULES`,
``(rule, op names)``; views, shapes, matmuls and reductions are
:mod:`keyinit.nn._batch.rules_tensor`'s). Each rule states a fact of the op's definition, not of the sizes it sees:

- convolutions treat dimension 0 of a batched input as independent rows; norms keep
  every position of their input in their output (their statistics are over the
  normalized dimensions); pooling and resampling keep every dimension before their
  spatial ones; fused attention computes each query row from that row and the keys;
- ``stack`` inserts a dimension; ``index.Tensor`` (advanced indexing) lays its result
  out as the indexing rules of NumPy and torch say; FFTs keep the dimensions they do not
  transform; ``as_strided`` that keeps every element in place (a memory-format fix-up)
  keeps the record, and otherwise, of a contiguous tensor, keeps the samples where its
  strides and extents say each output index stays within one sample's block of memory.

A batch dimension that an op mixes (convolved channels, a normalized or transformed
dimension, a pooled dimension) gives an output of unknown batch. Rows of it picked or
written by index values (a router's dispatch, a segment reduce, ``_grouped_mm`` of the
picked rows) are followed on the values (:mod:`keyinit.nn._batch.routed`). ``log_sigmoid_forward`` is
element-wise; ``linalg_solve_triangular`` solves one system per index of its leading dimensions.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from keyinit.nn._batch.records import Batch, Record, Unknown, arg, merge
from keyinit.nn._batch.routed import picked, put_rows, written_batch

__all__ = ["RULES", "restride_keeps_elements"]


def _record_of(records: list, tensor: Any) -> Record:
    return next((r for t, r in records if t is tensor), None)


def _sized(rec: Record, t: torch.Tensor) -> Optional[int]:
    return int(t.shape[rec.dim]) if isinstance(rec, Batch) and rec.dim is not None else None


def _kept(rec: Record, allowed: Sequence[int], what: str) -> Record:
    """``rec`` when its batch dimension is one the op keeps in place (its size unchanged), else unknown."""
    if not isinstance(rec, Batch) or rec.dim is None or rec.dim in allowed:
        return rec
    return Unknown(f"{what} mixes elements along the batch dimension {rec.dim}")


def _others_replicated(records: list, first: Any, what: str) -> Optional[Unknown]:
    """An unknown record when a tensor argument other than ``first`` (a weight, a bias) holds a batch."""
    for t, r in records:
        if t is not first and r is not None:
            return r if isinstance(r, Unknown) else Unknown(f"{what} takes a batch-holding {tuple(t.shape)} "
                                                            "tensor as a weight")
    return None


# ----------------------------------------------------------------------------- convolutions, norms, pooling


def _rule_convolution(func, args, kwargs, outs, records):
    """``(N, C_in, *spatial) -> (N, C_out, *spatial')``: rows of dimension 0 are convolved independently
    (an unbatched ``(C_in, *spatial)`` input has no independent dimension)."""
    input, weight = args[0], args[1]
    bad = _others_replicated(records, input, str(func))
    if bad is not None:
        return [bad]
    batched = input.dim() == weight.dim()
    return [_kept(_record_of(records, input), (0,) if batched else (), str(func))]


def _rule_layer_norm(func, args, kwargs, outs, records):
    """``(out, mean, rstd)`` or ``(out, rstd)``: ``out`` keeps every position; the statistics keep the
    dimensions before the normalized ones (size 1 in the normalized ones)."""
    input = args[0]
    rec = _record_of(records, input)
    bad = _others_replicated(records, input, str(func))
    if bad is not None:
        return [bad] * len(outs)
    axis = input.dim() - len(args[1])
    result: list[Record] = [rec]
    for _ in outs[1:]:
        if isinstance(rec, Batch) and rec.dim is not None and rec.dim >= axis:
            result.append(None)  # statistics over the batch: the same for every sample
        else:
            result.append(rec)
    return result[:len(outs)]


def _rule_group_norm(func, args, kwargs, outs, records):
    """``(N, C, *) -> out, mean (N, group), rstd (N, group)``: rows of dimension 0 are normalized apart."""
    input = args[0]
    rec = _record_of(records, input)
    bad = _others_replicated(records, input, str(func))
    if bad is not None:
        return [bad] * len(outs)
    kept = _kept(rec, (0,), str(func))
    return [kept] * len(outs)


def _rule_batch_norm(func, args, kwargs, outs, records):
    """``out`` keeps every position; the per-channel statistics are over dimension 0 and the spatial ones."""
    input = args[0]
    rec = _record_of(records, input)
    for t, r in records:
        if t is not input and r is not None:  # a batch-holding running statistic or weight
            return [r if isinstance(r, Unknown) else Unknown(f"{func} takes a batch-holding {tuple(t.shape)} "
                                                             "statistic or weight")] * len(outs)
    stats: Record = rec
    if isinstance(rec, Batch) and rec.dim is not None:
        stats = None if rec.dim != 1 else Unknown(f"{func} normalizes per channel and the batch is dimension 1")
    return [rec] + [stats] * (len(outs) - 1)


def _spatial(k: int):
    """Pooling and resampling over the last ``k`` dimensions: the dimensions before them are kept."""

    def rule(func, args, kwargs, outs, records):
        input = args[0]
        rec = _record_of(records, input)
        kept = _kept(rec, range(max(input.dim() - k, 0)), str(func))
        return [kept if isinstance(o, torch.Tensor) else None for o in outs]

    return rule


def _rule_im2col(func, args, kwargs, outs, records):
    """``(N, C, H, W) -> (N, C*kh*kw, L)``; an unbatched ``(C, H, W)`` input keeps nothing."""
    input = args[0]
    return [_kept(_record_of(records, input), (0,) if input.dim() == 4 else (), str(func))]


# ----------------------------------------------------------------------------- fused attention


def _rule_attention(func, args, kwargs, outs, records):
    """Each output row ``(..., l, :)`` is computed from query row ``(..., l, :)`` and the keys/values of the
    same leading index: the query's batch, in a leading dimension or the query-length one, is the output's;
    keys, values and the mask must hold no batch or the same one (aligned from the right)."""
    query = args[0]
    qrec = _record_of(records, query)
    if isinstance(qrec, Unknown):
        return [qrec] * len(outs)
    nd = query.dim()
    if isinstance(qrec, Batch) and qrec.dim is not None and qrec.dim >= nd - 1:
        return [Unknown(f"{func} contracts the query's feature dimension, which holds the batch")] * len(outs)
    mask = arg(func, args, kwargs, "attn_mask", None)
    if mask is None:
        mask = arg(func, args, kwargs, "attn_bias", None)
    for other, contracted in ((args[1], nd - 2), (args[2], nd - 2), (mask, None)):
        if not isinstance(other, torch.Tensor):
            continue
        rec = _record_of(records, other)
        if rec is None:
            continue
        if isinstance(rec, Unknown):
            return [rec] * len(outs)
        if isinstance(rec, Batch) and rec.dim is not None:
            aligned = rec.dim + nd - other.dim()
            if contracted is not None and aligned >= contracted:
                return [Unknown(f"{func} attends across keys whose batch is in their sequence or feature "
                                "dimension")] * len(outs)
            if mask is other and aligned == nd - 1:
                return [Unknown(f"{func}: the attention mask holds the batch in its key dimension")] * len(outs)
        found = merge([(qrec, nd, _sized(qrec, query)), (rec, other.dim(), _sized(rec, other))], nd, str(func))
        if isinstance(found, Unknown):
            return [found] * len(outs)
        qrec = found
    result: list[Record] = []
    for o in outs:
        if not isinstance(o, torch.Tensor) or o.dim() < nd - 1:
            result.append(None)  # seeds, offsets, cumulative lengths: no rows
        elif isinstance(qrec, Batch) and qrec.dim is not None and int(o.shape[qrec.dim]) != int(
                query.shape[qrec.dim]):
            result.append(Unknown(f"{func} gives an output whose dimension {qrec.dim} is not the query's"))
        else:
            result.append(qrec)  # the output (..., L, Ev), the log-sum-exp (..., L), the weights (..., L, S)
    return result


# ----------------------------------------------------------------------------- stack, indexing, FFT, strides


def _rule_stack(func, args, kwargs, outs, records):
    """``stack(tensors, dim)`` inserts dimension ``dim``: pieces holding the same batch keep it (moved past
    the new dimension); one selected sample per piece, consecutive, makes the new dimension the batch."""
    tensors = list(args[0])
    nd = outs[0].dim()
    dim = int(arg(func, args, kwargs, "dim", 0)) % nd
    recs = [_record_of(records, t) for t in tensors]
    if any(isinstance(r, Unknown) for r in recs):
        return [next(r for r in recs if isinstance(r, Unknown))]
    batches = [r for r in recs if isinstance(r, Batch)]
    if not batches:
        return [None]
    if len(batches) == len(recs) and all(r.dim is None and r.count == 1 for r in batches):
        starts = [r.start for r in batches]
        if starts == list(range(starts[0], starts[0] + len(starts))):
            return [Batch(dim, len(starts), starts[0])]
    first = batches[0]
    if all(r == first for r in batches):
        if first.dim is None:
            return [first]
        return [first.moved(first.dim + 1 if dim <= first.dim else first.dim)]
    return [Unknown(f"{func} stacks tensors whose batches differ")]


def _rule_index(func, args, kwargs, outs, records):
    """``self[indices]`` with index tensors (``aten.index.Tensor``).

    The index tensors broadcast together to a shape ``I``; the dimensions they index
    are replaced by ``I``'s, in place when the indexed dimensions are adjacent, first
    otherwise. A batch in a dimension that is not indexed moves with it; a batch in an
    index tensor (each sample looks up its own rows of a table) is the output's in
    ``I``'s dimensions; a batch in an indexed dimension (rows picked by value) is unknown.
    """
    self = args[0]
    indices = list(args[1])
    rec = _record_of(records, self)
    if isinstance(rec, Unknown):
        return [rec]
    consumed: list[tuple[int, int, Any]] = []  # (first self dim, number of self dims, index tensor)
    position = 0
    for index in indices:
        width = 1 if index is None or index.dtype not in (torch.bool, torch.uint8) else index.dim()
        if index is not None:
            consumed.append((position, width, index))
        position += width
    if not consumed:
        return [rec]
    # a mask index becomes one dimension (its true elements); the index tensors broadcast from the right
    index_nd = max(1 if i.dtype in (torch.bool, torch.uint8) else i.dim() for _, _, i in consumed)
    covered = {d for first, width, _ in consumed for d in range(first, first + width)}
    adjacent = all(consumed[k + 1][0] == consumed[k][0] + consumed[k][1] for k in range(len(consumed) - 1))
    lead = consumed[0][0] if adjacent else 0  # where I's dimensions go in the output
    out_nd = outs[0].dim()

    def moved(d: int) -> int:  # a dimension of self that is not indexed, in the output
        before = sum(1 for e in range(d) if e not in covered)
        if adjacent and d >= consumed[0][0]:
            return before + index_nd
        return before + (0 if adjacent else index_nd)

    candidates: list[tuple[Record, int, Optional[int]]] = []
    if isinstance(rec, Batch):
        if rec.dim is not None and rec.dim in covered:
            picker = next((i for first, width, i in consumed if first == rec.dim and width == 1), None)
            if picker is None or not _own_rows(self, rec, picker, _record_of(records, picker)):
                return [_picked_rows(func, self, rec, consumed, lead)]
            # every element picks a row of its own sample (x[arange(B)[:, None], ...]): the index's batch,
            # added below, is the output's
        else:
            candidates.append((rec if rec.dim is None else rec.moved(moved(rec.dim)), out_nd, None))
    for _, _, index in consumed:
        irec = _record_of(records, index)
        if irec is None:
            continue
        if isinstance(irec, Unknown):
            return [irec]
        if index.dtype in (torch.bool, torch.uint8):
            return [Unknown(f"{func} selects by a batch-holding mask (which elements it keeps depends on values)")]
        if isinstance(irec, Batch) and irec.dim is not None:
            aligned = irec.dim + index_nd - index.dim()
            size = int(index.shape[irec.dim])
            # size 1 and one sample: broadcast against the others (or the one sample of a 1-row forward): merge
            candidates.append((irec.moved(lead + aligned), out_nd, size))
        else:
            candidates.append((irec, out_nd, None))
    return [merge(candidates, out_nd, str(func))]


def _picked_rows(func: Any, self: torch.Tensor, rec: Batch, consumed: list, lead: int) -> Record:
    """``self[indices]`` whose indices pick rows of the batch dimension by their values: routed rows
    (:mod:`keyinit.nn._batch.routed`) when one 1-D index or one mask does, the batch dimension among the ones the
    mask covers; rows picked together with positions of other dimensions keep only their samples."""
    masks = [i for _, _, i in consumed if i.dtype in (torch.bool, torch.uint8)]
    if masks and len(consumed) > 1:
        return Unknown(f"{func} picks elements of the batch dimension {rec.dim} by a mask and other indices")
    with torch._C.DisableTorchFunction():
        if masks:
            first, width, mask = consumed[0]
            sizes = [int(n) for n in self.shape[first:first + width]]
            after = math.prod(int(n) for n in self.shape[rec.dim + 1:first + width])
            base = Batch(first, rec.count, rec.start, rec.inner * after)
            return picked(base, math.prod(sizes), lead, mask.reshape(-1).nonzero().reshape(-1))
        picker = next(((w, i) for first, w, i in consumed if first == rec.dim), None)
        if picker is None or picker[0] != 1 or picker[1].is_floating_point():
            return Unknown(f"{func} picks elements of the batch dimension {rec.dim} by index")
        index = picker[1]
        shape = torch.broadcast_shapes(*(i.shape for _, _, i in consumed))
        if len(shape) != 1:
            return Unknown(f"{func} picks rows of the batch dimension {rec.dim} by a multi-dimensional index")
        found = picked(rec, int(self.shape[rec.dim]), lead, index.expand(shape))
    if len(consumed) > 1 and type(found) is not Batch:
        found = found.moved(found.dim, None, found.samples)  # other dimensions picked too: samples only
    return found


def _own_rows(self: torch.Tensor, rec: Batch, index: torch.Tensor, irec: Record) -> bool:
    """True when ``index`` (which picks along ``self``'s batch dimension) holds the batch of the same forward
    and each of its elements picks a row of its own sample: checked on its values."""
    if not isinstance(irec, Batch) or irec.dim is None or (irec.start, irec.count) != (rec.start, rec.count):
        return False
    if index.dtype in (torch.bool, torch.uint8) or index.is_floating_point():
        return False
    with torch._C.DisableTorchFunction():
        size = int(self.shape[rec.dim])
        picked = (index.remainder(size).div(rec.inner, rounding_mode="floor")).remainder(rec.count)
        shape = [1] * index.dim()
        shape[irec.dim] = int(index.shape[irec.dim])
        own = torch.arange(shape[irec.dim], device=index.device).div(irec.inner, rounding_mode="floor")
        own = own.remainder(irec.count).reshape(shape)
        return bool(torch.equal(picked, own.expand_as(picked).to(picked.dtype)))


def _rule_fft(func, args, kwargs, outs, records):
    """``_fft_c2c/_fft_r2c/_fft_c2r(self, dim, ...)``: the dimensions not transformed are kept."""
    self = args[0]
    rec = _record_of(records, self)
    dims = {int(d) % max(self.dim(), 1) for d in args[1]}
    return [_kept(rec, [d for d in range(self.dim()) if d not in dims], str(func))]


def _rule_as_strided(func, args, kwargs, outs, records):
    """A view of a contiguous tensor by explicit sizes and strides.

    In a contiguous input whose batch is dimension ``d`` (stride ``s``), the element at
    memory offset ``o`` from the input's start belongs to local sample
    ``(o // (s * inner)) % count``. An output dimension ``e`` whose stride divides
    ``s * inner`` holds the batch when the other dimensions, at their largest
    indices, move less than that stride from the view's start (so they never cross
    into the next run of ``e``): then output index ``j`` of ``e`` is in sample
    ``(j // (s * inner / stride_e)) % count``.
    """
    self = args[0]
    rec = _record_of(records, self)
    if not isinstance(rec, Batch) or rec.dim is None:
        return [rec]
    size, stride = [int(v) for v in args[1]], [int(v) for v in args[2]]
    offset = arg(func, args, kwargs, "storage_offset", None)
    offset = 0 if offset is None else int(offset) - self.storage_offset()
    if not self.is_contiguous() or offset < 0 or any(v < 0 for v in stride):
        return [Unknown(f"{func} of a non-contiguous tensor, or with negative strides or offset")]
    block = int(self.stride(rec.dim)) * rec.inner  # memory of one sample's run in the batch dimension
    reach = offset + sum((n - 1) * st for n, st in zip(size, stride) if n > 0)
    if 0 in size or reach < block:
        return [Batch(None, 1, rec.start)]  # the whole view lies in the first sample's run
    for e, (n, st) in enumerate(zip(size, stride)):
        if n <= 1 or st <= 0 or block % st:
            continue
        rest = reach - (n - 1) * st  # the farthest the other dimensions (and the offset) reach
        if rest >= st:
            continue
        inner = block // st
        if n % (inner * rec.count) == 0:
            return [Batch(e, rec.count, rec.start, inner)]
        if n % inner == 0 and n < inner * rec.count:
            return [Batch(e, n // inner, rec.start, inner)]
    return [Unknown(f"{func} lays the batch out in a way keyinit cannot follow (sizes {size}, strides {stride})")]


def restride_keeps_elements(t: torch.Tensor, args: tuple) -> bool:
    """True when ``as_strided(t, size, stride[, offset])`` views the same elements at the same positions."""
    size, stride = list(args[1]), list(args[2])
    offset = args[3] if len(args) > 3 and args[3] is not None else t.storage_offset()
    return (list(t.shape) == size and offset == t.storage_offset()
            and all(n == 1 or a == b for n, a, b in zip(size, t.stride(), stride)))


def _rule_restride(func, args, kwargs, outs, records):
    """``as_strided``/``as_strided_`` that keeps the size, the storage offset and the stride of every
    dimension of size > 1 (a memory-format fix-up, as adaptive pooling does): the same elements."""
    t, rec = records[0]
    if restride_keeps_elements(t, args) or not isinstance(rec, Batch):
        return [rec]
    return _rule_as_strided(func, args, kwargs, outs, records)  # a new view of contiguous memory


def _rule_scatter(func, args, kwargs, outs, records):
    """``scatter/scatter_add/scatter_reduce(self, dim, index, src)``: ``out[..i.., index[..i..], ..] = src[..i..]``
    along ``dim``; every other dimension of ``index``/``src`` is the output's. A batch of ``index``/``src`` in
    ``dim`` lands where their values say: then only ``self``'s own layout places the output's samples."""
    self, dim = args[0], int(args[1]) % max(args[0].dim(), 1)
    rec = _record_of(records, self)
    others = [(t, _record_of(records, t)) for t in args[2:4] if isinstance(t, torch.Tensor)]
    if any(isinstance(r, Batch) and r.dim == dim for _, r in others):
        if isinstance(rec, Batch):
            return [rec]
        src = args[3] if len(args) > 3 and isinstance(args[3], torch.Tensor) else None
        srec = _record_of(records, src) if src is not None else None
        if isinstance(srec, Batch) and srec.dim in (dim, None) and tuple(args[2].shape) == tuple(src.shape):
            # a segment reduce into a tensor laid out per sample (TAPAS): where each element went, by value
            return [written_batch(self, rec, dim, args[2], src, srec)]
        return [Unknown(f"{func} writes rows of the batch dimension by index")]
    return [merge([(r, t.dim(), None) for t, r in [(self, rec), *others]], self.dim(), str(func))]


def _rule_index_into(func, args, kwargs, outs, records):
    """``index_add/index_copy/index_fill/index_reduce(self, dim, index, source)``: rows ``index[j]`` of ``dim``
    take row ``j`` of ``source``; the other dimensions of ``source`` are ``self``'s."""
    self, dim = args[0], int(args[1]) % max(args[0].dim(), 1)
    rec = _record_of(records, self)
    if isinstance(rec, Batch):
        return [rec]  # self's positions keep their samples; what is written there is the model's business
    index = args[2]
    source = args[3] if len(args) > 3 and isinstance(args[3], torch.Tensor) else None
    srec = _record_of(records, source) if source is not None else None
    if isinstance(srec, Batch) and srec.dim in (dim, None):
        return [written_batch(self, rec, dim, index, source, srec)]  # where each row went, by value
    if _record_of(records, index) is not None:
        return [Unknown(f"{func} writes by a batch-holding index")]
    return [merge([(rec, self.dim(), None), (srec, self.dim(), None)], self.dim(), str(func))]


def _rule_grouped_mm(func, args, kwargs, outs, records):
    """``_grouped_mm(self (S, K), mat2 (G, K, N), offs)``: row ``i`` of the output is row ``i`` of ``self`` times
    the matrix of its group, the groups given by the values of ``offs`` (a router's choice of parameters,
    not of rows): the output's rows are ``self``'s. The other forms are not followed."""
    self, mat2 = args[0], args[1]
    rec = {id(t): r for t, r in records}
    ra, rb = rec.get(id(self)), rec.get(id(mat2))
    if self.dim() != 2 or mat2.dim() != 3 or rb is not None or (isinstance(ra, Batch) and ra.dim not in (None, 0)):
        return [ra if isinstance(ra, Unknown) else Unknown(f"{func} of these operands is not followed")]
    bias = arg(func, args, kwargs, "bias")
    cands: list[tuple[Record, int, Optional[int]]] = [(ra, 2, None)]
    if isinstance(bias, torch.Tensor):
        cands.append((rec.get(id(bias)), bias.dim(), None))
    return [merge(cands, 2, func)]


def _rule_put_into(func, args, kwargs, outs, records):
    """``index_put/_index_put_impl_/masked_scatter/put_``: ``self``'s positions, some overwritten where index
    or mask values say: a batch-holding ``self`` keeps its layout; values that hold a batch written into a
    tensor that holds none land at places keyinit cannot follow."""
    self = args[0]
    rec = _record_of(records, self)
    if isinstance(rec, Batch):
        return [rec]
    if func._schema.name in ("aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        found = put_rows(func, args, records)  # rows of the batch written back: where each went, by value
        if found is not None:
            return [found]
    for t, r in records:
        if t is not self and r is not None:
            return [r if isinstance(r, Unknown) and not r.constant else
                    Unknown(f"{func} writes batch-holding values at places given by values")]
    return [rec]


def _rule_log_sigmoid_forward(func, args, kwargs, outs, records):
    """``log_sigmoid_forward(self) -> (output, buffer)``: both element-wise in ``self`` (the buffer is ``self``'s
    shape on the CPU, an empty tensor elsewhere: no elements, nothing to place)."""
    self = args[0]
    rec = _record_of(records, self)
    return [rec if isinstance(o, torch.Tensor) and tuple(o.shape) == tuple(self.shape) else None for o in outs]


def _rule_solve_triangular(func, args, kwargs, outs, records):
    """``linalg_solve_triangular(A (*, n, n), B (*, n, k), left)``: one solve per index of the broadcast leading
    dimensions. With ``left`` each column of ``X = A^-1 B`` is solved from the same column of ``B`` (with
    ``left=False``, ``X = B A^-1``: each row from its row); every element of ``A`` enters every element."""
    a, b = args[0], args[1]
    left = bool(arg(func, args, kwargs, "left", True))
    nd = outs[0].dim()
    ra, rb = _record_of(records, a), _record_of(records, b)
    if isinstance(ra, Batch) and ra.dim is not None and ra.dim >= a.dim() - 2:
        return [Unknown(f"{func} solves with a triangular matrix that holds the batch in its matrix dimension "
                        f"{ra.dim}")]
    if isinstance(rb, Batch) and rb.dim is not None and rb.dim == b.dim() - (2 if left else 1):
        return [Unknown(f"{func} solves along the batch dimension {rb.dim} of its right-hand side")]
    return [merge([(ra, a.dim(), _sized(ra, a)), (rb, b.dim(), _sized(rb, b))], nd, str(func))]


def _rule_factory_of(func, args, kwargs, outs, records):
    """``self.new_empty/new_zeros/new_ones/new_full(size)``: values that do not depend on ``self`` (its
    dtype and device only). The batch of the size (a ``BatchSize``) is set by the torch-function mode."""
    return [None]


#: ``(rule, op names)``: the family's entries of :mod:`keyinit.nn._batch.rules`'s table (each op named once in
#: all of the families).
RULES = (
    (_rule_convolution, ("aten::convolution", "aten::_convolution")),
    (_rule_layer_norm, ("aten::native_layer_norm", "aten::_fused_rms_norm", "aten::rms_norm")),
    (_rule_group_norm, ("aten::native_group_norm",)),
    (_rule_batch_norm, tuple(f"aten::{name}" for name in (
        "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
        "_native_batch_norm_legit_functional", "_batch_norm_with_update", "_batch_norm_no_update"))),
    (_rule_attention, tuple(f"aten::{name}" for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable"))),
    (_spatial(1), tuple(f"aten::{name}" for name in (
        "max_pool1d", "avg_pool1d", "adaptive_avg_pool1d", "adaptive_max_pool1d", "max_pool1d_with_indices",
        "upsample_nearest1d", "upsample_linear1d", "_upsample_nearest_exact1d", "reflection_pad1d",
        "replication_pad1d"))),
    (_spatial(2), tuple(f"aten::{name}" for name in (
        "max_pool2d_with_indices", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
        "adaptive_max_pool2d", "upsample_nearest2d", "upsample_bilinear2d", "upsample_bicubic2d",
        "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", "_upsample_nearest_exact2d", "reflection_pad2d",
        "replication_pad2d"))),
    (_spatial(3), tuple(f"aten::{name}" for name in (
        "max_pool3d_with_indices", "max_pool3d", "avg_pool3d", "adaptive_avg_pool3d", "_adaptive_avg_pool3d",
        "upsample_nearest3d", "upsample_trilinear3d", "_upsample_nearest_exact3d", "reflection_pad3d",
        "replication_pad3d", "pixel_shuffle", "pixel_unshuffle"))),
    (_rule_im2col, ("aten::im2col",)),
    (_rule_stack, ("aten::stack",)),
    (_rule_index, ("aten::index",)),
    # transformers' grouped matmul for torch.compile (transformers/integrations/moe.py): _grouped_mm's 2-D by
    # 3-D form, row i of the output from row i of the input (its docstring's contract)
    (_rule_grouped_mm, ("aten::_grouped_mm", "transformers::grouped_mm_fallback")),
    (_rule_fft, ("aten::_fft_c2c", "aten::_fft_r2c", "aten::_fft_c2r")),
    (_rule_restride, ("aten::as_strided",)),  # _rule_as_strided where the view is not a memory-format fix-up
    (_rule_scatter, tuple(f"aten::{name}" for name in (
        "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"))),
    (_rule_index_into, tuple(f"aten::{name}" for name in (
        "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_", "index_reduce",
        "index_reduce_"))),
    (_rule_put_into, tuple(f"aten::{name}" for name in (
        "index_put", "index_put_", "_index_put_impl_", "masked_scatter", "masked_scatter_", "put_", "put"))),
    (_rule_log_sigmoid_forward, ("aten::log_sigmoid_forward",)),
    (_rule_solve_triangular, ("aten::linalg_solve_triangular",)),
    (_rule_factory_of, tuple(f"aten::{name}" for name in (
        "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"))),
)
