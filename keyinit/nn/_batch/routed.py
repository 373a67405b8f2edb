"""Rows of the batch picked by values: mixture-of-experts dispatch, masked selection, ``index_select``.

An op that picks rows of a batch dimension by the values of an index gives rows
whose samples only those values say: ``x[idx]``, ``x.index_select(0, idx)`` and
``x[mask]`` on a ``(B*L, D)`` activation (a router sending tokens to its experts),
then ``zeros.index_add(0, idx, y)`` writing the experts' rows back. keyinit follows
the fact, on the values: such a tensor's record is a :class:`Routed`, which holds,
for each index ``i`` of its routed dimension,

- ``rows[i]``: the row of the *virtual* batch dimension it was picked from, a
  dimension of ``size`` rows laid out as ``Batch(count=count, start=start,
  inner=inner)`` (the dimension the first pick read, with the dimensions a mask
  covered merged into it);
- ``samples[i] = start + (rows[i] // inner) % count``: its global sample.

Ops that move, slice, join or compute on routed rows without mixing them carry
the record by the ordinary rules (:func:`proxied`: each distinct ``Routed`` is
shown to the rules as a batch of ``n`` one-row samples with a start no real batch
has, and mapped back). A second pick along the routed dimension composes the
index vectors; a ``gather`` along the batch dimension whose index rows each pick
one row (``idx[:, None].expand(-1, D)``) is a pick too. Writing rows of the batch,
routed or not, into a replicated or constant tensor by an index (``index_add``,
``index_copy``, ``out[idx] = y``, ``scatter``/``scatter_add``/``scatter_reduce``)
gives that tensor a batch when the values say every row went to a position of its
own sample (:func:`written`); into a tensor that holds the batch, its positions keep
their samples, as for any write. A ``Routed`` whose samples are laid
out as a batch again (``y[inv_perm]`` after ``x[perm]``) is that :class:`Batch`
(:func:`normalized`).

Element-wise dropout of routed rows is keyed as the same dropout of the virtual
tensor (the rows in their place in the batch) would be (:func:`routed_layout`), and
so is every other random op drawing per element (``rand_like``, ``uniform_``,
``bernoulli``: :func:`keyinit.nn._forward.draws.routed_rows`). A draw on rows known only by
their samples, or on a row picked twice, is refused (:func:`routed_draw`), and so is
whatever does not know a ``Routed`` (it is an :class:`Unknown`), as a pick by a
multi-dimensional index.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch

from keyinit._draw.dropout_geometry import Layout
from keyinit.errors import UnkeyedRandomnessError
from keyinit.nn._batch.records import Batch, Record, Unknown, canonical
from keyinit.regions import row_major_strides

__all__ = ["Routed", "picked", "composed", "normalized", "proxied", "unproxied", "written", "written_batch",
           "put_rows", "gathered_rows", "routed_rule", "routed_layout", "routed_draw", "needs_values", "duplicated"]

_WHY = ("its rows were picked from the batch by index values (a router's dispatch, a mask), and this draw "
        "cannot be keyed on them")


@attrs.frozen(eq=False)
class Routed(Unknown):
    """Rows of dimension ``dim`` picked by values from a virtual batch dimension (see the module docstring).

    The rows are ``length`` consecutive entries from ``first`` of one routing (``source_rows``,
    ``source_samples``: the pick that made them), so that slices of a routing joined again (an expert
    layer's ``split``, per-expert matmuls, ``cat``) are seen to be that routing. ``source_rows`` is None
    when only the samples are known. Compared by identity: it holds tensors.
    """

    dim: int = attrs.field(kw_only=True)
    count: int = attrs.field(kw_only=True)
    start: int = attrs.field(kw_only=True)
    inner: int = attrs.field(kw_only=True)
    size: int = attrs.field(kw_only=True)
    source_rows: Optional[torch.Tensor] = attrs.field(kw_only=True)
    source_samples: torch.Tensor = attrs.field(kw_only=True)
    first: int = attrs.field(kw_only=True, default=0)
    length: int = attrs.field(kw_only=True, default=-1)

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @property
    def n(self) -> int:
        return int(self.source_samples.numel()) if self.length < 0 else self.length

    @property
    def rows(self) -> Optional[torch.Tensor]:
        """The virtual batch row of each index of the routed dimension (None: unknown)."""
        if self.source_rows is None:
            return None
        return self.source_rows[self.first:self.first + self.n]

    @property
    def samples(self) -> torch.Tensor:
        """The global sample of each index of the routed dimension."""
        return self.source_samples[self.first:self.first + self.n]

    def moved(self, dim: int, rows: Optional[torch.Tensor], samples: torch.Tensor) -> "Routed":
        """The same virtual batch, rows ``rows`` (samples ``samples``) in dimension ``dim``: a new routing."""
        return Routed(self.why, dim=dim, count=self.count, start=self.start, inner=self.inner, size=self.size,
                      source_rows=rows, source_samples=samples)


_NoFunction = torch._C.DisableTorchFunction


def _samples(positions: torch.Tensor, count: int, start: int, inner: int) -> torch.Tensor:
    """The global sample of each of ``positions`` of a batch dimension laid out as ``Batch(count, start,
    inner)``: ``start + (position // inner) % count``."""
    return start + positions.div(inner, rounding_mode="floor").remainder(count)


def picked(rec: Batch, size: int, dim: int, index: torch.Tensor) -> Record:
    """The record of rows ``index`` (1-D integers or a 1-D index of flat positions) picked from a dimension of
    ``size`` rows whose batch is ``rec`` (a :class:`Batch` in that dimension), landing in dimension ``dim``."""
    with _NoFunction():
        rows = index.detach().reshape(-1).to(torch.int64, copy=True)
        rows = torch.where(rows < 0, rows + size, rows)
        samples = _samples(rows, rec.count, rec.start, rec.inner)
    return normalized(Routed(_WHY, dim=dim, count=rec.count, start=rec.start, inner=rec.inner, size=size,
                             source_rows=rows, source_samples=samples))


def composed(rec: Routed, dim: int, index: torch.Tensor) -> Record:
    """Rows ``index`` (1-D) of routed rows ``rec`` along its routed dimension, landing in dimension ``dim``."""
    with _NoFunction():
        index = index.detach().reshape(-1).to(torch.int64)
        rows = None if rec.rows is None else rec.rows.index_select(0, index.remainder(rec.rows.numel()))
        samples = rec.samples.index_select(0, index.remainder(max(rec.samples.numel(), 1)))
    return normalized(rec.moved(dim, rows, samples))


def normalized(rec: Routed) -> Record:
    """``rec``, or the :class:`Batch` it is.

    Rows that are the virtual batch dimension itself, in order, are its batch. Other rows, each picked once,
    stay routed: a draw keys them by their place in the batch, which no batch layout of the picked rows
    gives. Rows known only by their samples, or picked more than once (top-k routing's copies of a token),
    are a batch when each sample's rows are together and the samples in order (``y[inv_perm]`` after
    ``x[perm]``): a draw then keys them by their place among their sample's rows, as on any batch.
    """
    with _NoFunction():
        samples, rows = rec.samples, rec.rows
        n = int(samples.numel())
        if n == 0:
            return Batch(rec.dim, 0, rec.start)
        if rows is not None:
            if n == rec.size and bool(torch.equal(rows, torch.arange(n, device=rows.device))):
                return Batch(rec.dim, rec.count, rec.start, rec.inner)
            if int(torch.unique(rows).numel()) == n:
                return rec
        first, last = int(samples.min()), int(samples.max())
        if first == last:
            return Batch(rec.dim, 1, first, n)  # every row one sample's
        if n % rec.count == 0:
            inner = n // rec.count
            if bool(torch.equal(samples, _samples(torch.arange(n, device=samples.device), rec.count, rec.start,
                                                  inner))):
                return Batch(rec.dim, rec.count, rec.start, inner)
    return rec


# ----------------------------------------------------------------------------- through the ordinary rules

_SENTINEL = 1 << 62  # proxy k's start is -(k + 1) * _SENTINEL: no real batch starts below 0


def _same_rows(a: Routed, b: Routed) -> Optional[bool]:
    """Of two routings' sources: True, the same rows of the same virtual batch; None, the same samples
    only; False, other samples."""
    if a.source_samples is b.source_samples and a.source_rows is b.source_rows:
        return True
    with _NoFunction():
        if a.source_samples.shape != b.source_samples.shape or \
                not bool(torch.equal(a.source_samples, b.source_samples)):
            return False
        same_base = (a.count, a.start, a.inner, a.size) == (b.count, b.start, b.inner, b.size)
        if same_base and a.source_rows is not None and b.source_rows is not None and \
                bool(torch.equal(a.source_rows, b.source_rows)):
            return True
    return None


def proxied(records: list) -> tuple[list, list]:
    """``(records, groups)``: the routed records replaced by proxies, and the routings in proxy order.

    Routing ``k``'s proxy is a :class:`Batch` of one-row samples whose start, ``-(k + 1) * 2**62`` plus the
    record's first entry, no real batch has: the rules then keep slices of it apart from other rows and
    join consecutive slices of it again. Routings of the same samples by other rows share a proxy, as the
    samples only.
    """
    groups: list[Routed] = []
    out = []
    for t, r in records:
        if type(r) is not Routed:
            out.append((t, r))
            continue
        for k, g in enumerate(groups):
            same = _same_rows(g, r)
            if same is None and g.source_rows is not None:
                groups[k] = attrs.evolve(g, source_rows=None)
            if same is not False:
                break
        else:
            k = len(groups)
            groups.append(r)
        out.append((t, Batch(r.dim, r.n, -(k + 1) * _SENTINEL + r.first)))
    return out, groups


def unproxied(result: list, groups: list, what: Any) -> list:
    """The rules' ``result`` with proxy batches mapped back to the routings they stand for."""
    out = []
    for r in result:
        if type(r) is Routed and r.start < 0:  # (a pick of a proxy: no rule should make one)
            out.append(Unknown(f"{what} picks rows picked by values again in a way keyinit does not follow"))
            continue
        if not isinstance(r, Batch) or r.start >= 0:
            out.append(r)
            continue
        k = (-r.start - 1) // _SENTINEL
        first = r.start + (k + 1) * _SENTINEL
        g = groups[k] if 0 <= k < len(groups) else None
        if g is None or r.dim is None or r.inner != 1 or first + r.count > int(g.source_samples.numel()):
            out.append(Unknown(f"{what} lays out rows picked by values in a way keyinit does not follow"))
            continue
        out.append(normalized(attrs.evolve(g, dim=r.dim, first=first, length=r.count)))
    return out


# ----------------------------------------------------------------------------- writes back


def written(dest: torch.Tensor, rec: Record, dim: int, index: torch.Tensor, samples: torch.Tensor, source: Any,
            size: int) -> Record:
    """The record of ``dest`` (record ``rec``: replicated or constant) after positions ``index`` of its
    dimension ``dim`` took rows of ``samples`` (the global sample of each source row along ``dim``), picked
    from (or being) a batch dimension of ``size`` rows laid out as ``source`` (a :class:`Batch` or
    :class:`Routed`): that layout, scaled to ``dest``'s rows, when the values say every row went to a
    position of its own sample; else unknown. ``index`` is 1-D (``index_add``: one position per source row)
    or the source's shape (``scatter``: one per element)."""
    if not (rec is None or (type(rec) is Unknown and rec.constant)):
        return Unknown("rows of the batch written by index into a tensor whose batch is unknown")
    m = int(dest.shape[dim])
    if (source.inner * m) % size:
        return Unknown(f"rows of the batch written by index into a dimension of {m} rows (from {size})")
    layout = Batch(dim, source.count, source.start, source.inner * m // size)
    with _NoFunction():
        index = index.detach().to(torch.int64)
        if index.dim() <= 1:
            index, where = index.reshape(-1), samples
        else:
            shape = [1] * index.dim()
            shape[dim] = -1
            where = samples.reshape(shape)[tuple(slice(0, int(n)) for n in index.shape)].expand(index.shape)
        if index.shape != where.shape:
            return Unknown("an index_add/index_copy whose index and source rows differ in number")
        at = _samples(index.remainder(m), layout.count, layout.start, layout.inner)
        if not bool(torch.equal(at, where)):
            return Unknown("rows of the batch were written by index to positions of other samples")
    return layout


def written_batch(dest: torch.Tensor, rec: Record, dim: int, index: torch.Tensor, source: torch.Tensor,
                  srec: Batch) -> Record:
    """:func:`written` of rows of ``source``, whose batch ``srec`` is in ``dim`` (or, ``dim`` None, its one
    sample's, a forward of one row)."""
    n = int(source.shape[dim])
    if srec.dim is None:
        srec = Batch(dim, 1, srec.start, max(n, 1))
    with _NoFunction():
        samples = _samples(torch.arange(n, device=source.device), srec.count, srec.start, srec.inner)
    return written(dest, rec, dim, index, samples, srec, n)


# ----------------------------------------------------------------------------- draws


def routed_layout(shape: tuple, rec: Routed) -> Optional[Layout]:
    """Where the elements of a tensor of ``shape`` whose routed rows are ``rec`` sit in the stream: where the same
    elements of the virtual tensor (the rows in their place in the batch) sit; None when the rows are unknown."""
    if rec.rows is None:
        return None
    d = rec.dim
    vshape = tuple(shape[:d]) + (rec.size,) + tuple(shape[d + 1:])
    vrec = Batch(d, rec.count, rec.start, rec.inner)
    split, order, sample_shape = canonical(vshape, vrec)
    strides = row_major_strides((rec.start + rec.count,) + sample_shape)
    gs = tuple(strides[order.index(i)] for i in range(len(split)))
    with _NoFunction():
        rows = rec.rows
        offsets = (gs[d] * rows.div(rec.count * rec.inner, rounding_mode="floor")
                   + gs[d + 1] * (rec.start + rows.div(rec.inner, rounding_mode="floor").remainder(rec.count))
                   + gs[d + 2] * rows.remainder(rec.inner))
    gstrides = gs[:d] + (1,) + gs[d + 3:]
    indices = (None,) * d + (offsets.to("cpu"),) + (None,) * (len(shape) - d - 1)
    return Layout(gstrides, (0,) * len(shape), indices)


# ----------------------------------------------------------------------------- ops that read the values


def routed_rule(func: Any, args: tuple, kwargs: dict, records: list) -> Optional[list]:
    """The records of an op that picks or writes routed rows by index (a second pick composes, a write back
    is checked on the values); None for an op the ordinary rules carry routed rows through."""
    name = func._schema.name
    rec = next((r for t, r in records if t is args[0]), None)
    if name == "aten::index_select":
        dim = int(args[1]) % max(args[0].dim(), 1)
        if type(rec) is Routed and rec.dim == dim:
            return [composed(rec, dim, args[2])]
        return None
    if name == "aten::index":
        if type(rec) is not Routed:
            return None
        indices = list(args[1])
        position, covering = 0, []
        for index in indices:
            width = 1 if index is None or index.dtype not in (torch.bool, torch.uint8) else index.dim()
            if index is not None and position <= rec.dim < position + width:
                covering.append((position, width, index))
            position += width
        if not covering:
            return None
        picks = [i for i in indices if i is not None]
        first, width, index = covering[0]
        if len(picks) == 1 and width == 1 and index.dim() == 1:
            if index.dtype in (torch.bool, torch.uint8):
                with _NoFunction():
                    index = index.nonzero().reshape(-1)
            return [composed(rec, rec.dim, index)]
        return [Unknown(f"{func} picks rows picked by values again, by a multi-dimensional index")]
    if name == "aten::gather":
        dim = int(args[1]) % max(args[0].dim(), 1)
        if type(rec) is not Routed or rec.dim != dim:
            return None
        rows = _gathered(args[0], dim, args[2])
        if rows is None:
            return [Unknown(f"{func} gathers elements of several rows picked by values")]
        return [composed(rec, dim, rows)]
    if name.startswith("aten::scatter"):
        dest, dim = args[0], int(args[1]) % max(args[0].dim(), 1)
        src = args[3] if len(args) > 3 and isinstance(args[3], torch.Tensor) else None
        srec = next((r for t, r in records if t is src), None) if src is not None else None
        if type(srec) is not Routed or srec.dim != dim or isinstance(rec, Batch):
            return None
        if tuple(args[2].shape) != tuple(src.shape):
            return [Unknown(f"{func} writes rows picked by values by an index shaped unlike them")]
        return [written(dest, rec, dim, args[2], srec.samples, srec, srec.size)]
    if name in ("aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        found = None if isinstance(rec, Batch) else put_rows(func, args, records)
        return None if found is None else [found]
    if name in ("aten::index_add", "aten::index_add_", "aten::index_copy", "aten::index_copy_"):
        dest, dim = args[0], int(args[1]) % max(args[0].dim(), 1)
        source = next((r for t, r in records if t is args[3]), None)
        if type(source) is not Routed or source.dim != dim:
            return None
        if isinstance(rec, Batch):
            return [rec]  # dest's positions keep their samples (keyinit.nn._batch.rules_nn._rule_index_into)
        return [written(dest, rec, dim, args[2], source.samples, source, source.size)]
    return None


def put_rows(func: Any, args: tuple, records: list) -> Optional[Record]:
    """``index_put(self, indices, values)`` of rows of the batch (``values`` routed, or a batch in the indexed
    dimension) into a replicated or constant ``self`` by one 1-D index: :func:`written`'s record; None for
    any other form."""
    dest, indices, values = args[0], list(args[1]), args[2]
    picks = [(p, i) for p, i in enumerate(indices) if i is not None]
    if len(picks) != 1 or not isinstance(values, torch.Tensor) or values.dim() != dest.dim():
        return None
    p, index = picks[0]
    if index.dim() != 1 or index.is_floating_point():
        return None
    if index.dtype in (torch.bool, torch.uint8):
        with _NoFunction():
            index = index.nonzero().reshape(-1)
    vrec = next((r for t, r in records if t is values), None)
    rec = next((r for t, r in records if t is dest), None)
    n = int(values.shape[p])
    if n != int(index.numel()):
        return None
    if type(vrec) is Routed and vrec.dim == p:
        return written(dest, rec, p, index, vrec.samples, vrec, vrec.size)
    if type(vrec) is Batch and vrec.dim in (p, None):
        return written_batch(dest, rec, p, index, values, vrec)
    return None


def _gathered(x: torch.Tensor, dim: int, index: torch.Tensor) -> Optional[torch.Tensor]:
    """The row of ``x`` each index row of ``x.gather(dim, index)`` picks, when every element of an index row
    picks the same row (``idx[:, None].expand(-1, D)``) and the index has ``x``'s sizes elsewhere; else None."""
    same_sizes = all(int(index.shape[d]) == int(x.shape[d]) for d in range(x.dim()) if d != dim)
    if index.dim() != x.dim() or not same_sizes or index.numel() == 0:
        return None
    with _NoFunction():
        rows = index.movedim(dim, 0).reshape(int(index.shape[dim]), -1)
        return rows[:, 0] if bool(torch.equal(rows, rows[:, :1].expand_as(rows))) else None


def gathered_rows(rec: Batch, x: torch.Tensor, dim: int, index: torch.Tensor) -> Record:
    """``x.gather(dim, index)`` along ``x``'s batch dimension ``dim``: rows picked by values (:func:`_gathered`),
    else unknown."""
    rows = _gathered(x, dim, index)
    if rows is None:
        return Unknown("a gather along the batch dimension whose index rows pick elements of several rows")
    return picked(rec, int(x.shape[dim]), dim, rows)


def routed_draw(frame: Any, rec: Routed, what: str, shape: tuple) -> Routed:
    """``rec`` for a random op drawing per element on routed rows, or the UnkeyedRandomnessError that says why
    it cannot be keyed (the rows' places in their samples unknown, or a row picked twice)."""
    why = None
    if rec.rows is None:
        why = ("whose places in their samples keyinit does not follow (rows routed two ways, or picked with "
               "positions of other dimensions)")
    elif duplicated(rec):
        why = "where some row was picked more than once (a token sent to several experts): its copies would draw alike"
    if why is not None:
        raise UnkeyedRandomnessError(
            f"{frame.describe()}: {what} on a {shape or 'sized'} tensor of rows picked from the batch by index "
            f"values, {why}. Draw before the rows are picked or after they are written back, or declare the "
            "batch with keyinit.nn.batch_dim")
    return rec


def needs_values(what: str) -> RuntimeError:
    """The error for a graph being traced where ``what`` depends on values: :mod:`keyinit.nn._compiled.compile` runs
    that graph eagerly under keyed()'s modes (its message is the one the trace takes for ``.item()``)."""
    return RuntimeError(f"keyinit: cannot get value out of a tracing tensor: {what} depends on values")


def duplicated(rec: Routed) -> bool:
    """Some row of the virtual batch was picked more than once (top-k routing's copies of a token)."""
    with _NoFunction():
        return rec.rows is not None and int(torch.unique(rec.rows).numel()) != int(rec.rows.numel())
