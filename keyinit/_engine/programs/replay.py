"""Replay: evaluate any region of a captured program, on the CPU, bit-identically under any layout.

:class:`Evaluator` computes the values of :mod:`keyinit._engine.programs.program` nodes at any set
of elements (``at``: row-major flat positions) or whole (``full``). Every way of
evaluating a node gives the same bits:

- draws come from :mod:`keyinit.random` (values depend only on the key and the
  element's flat index) or a :mod:`keyinit.init` initializer over a region;
- element-wise math on nodes of at most :data:`CALL` elements runs in one call over
  the whole node (as eager torch runs it, so deterministic buffers match eager's bits);
  on larger nodes it runs in blocks of :data:`BLOCK` elements aligned to the
  node's own flat indices, at most :data:`CALL` elements per torch call, so every
  element takes the same vectorized code path whatever region was asked for
  (torch's CPU kernels switch between SIMD bodies and scalar tails by position);
- data movement (views, copies, ``cat``, dtype conversion) is exact;
- a run of consecutive positions (a whole tensor, a row shard, a chunk of one) is evaluated
  without listing them where the node allows (:meth:`Evaluator.run`): a draw as the whole rows
  that hold the run, each part of a ``cat`` as the one run of its own elements the run holds
  (torchtitan's fused q/k/v weights), a read of a whole buffer as its latest whole write. Only
  the work changes, never a value: an element's draw depends on its index, not on the box.

:func:`write_target` writes one model tensor's program into a
:class:`keyinit.layouts.Target` (this process's region): a whole-tensor draw or
fill is written straight by the initializer (the fast kernels, on the target's
device); later writes through views touch only the part of the region they cover;
anything else is evaluated in chunks of the region on the CPU and copied.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Optional

import attrs
import torch

from keyinit.errors import UnkeyedRandomnessError
from keyinit.keys import Key
from keyinit._engine.programs.guard import run_fill
from keyinit.layouts import Target
from keyinit._engine.programs.program import (
    Alloc, Cat, Const, StridedView, Item, Literal, Node, Pointwise, Random, Read, SlotProgram, Suppressed,
    Version, Whole, Write, iter_nodes, ravel, unravel, root_of, written_mask,
)
from keyinit.regions import make_region, row_major_strides

__all__ = ["Evaluator", "write_target", "element_local", "BLOCK", "CALL", "CHUNK"]

#: Element-wise math is evaluated in blocks of this many elements, aligned to flat indices.
BLOCK = 64
#: At most this many elements per torch call (below torch's intra-op parallel grain, 32768).
CALL = 32768
#: Region elements evaluated at once on the general path (bounded workspace).
CHUNK = 1 << 18

_CPU = torch.device("cpu")


class UninitializedRead(RuntimeError):
    """A program reads elements nothing wrote."""


def _run_start(pos: torch.Tensor) -> Optional[int]:
    """``pos[0]`` if ``pos`` is a run of consecutive positions, else ``None``."""
    n = int(pos.numel())
    if n == 0:
        return None
    first = int(pos[0])
    if int(pos[-1]) - first != n - 1:
        return None
    return first if n == 1 or bool((pos[1:] - pos[:-1] == 1).all()) else None


def _unique_inverse(coord: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(coord, sorted=True, return_inverse=True)`` for coordinates below ``size``:
    by a mask of ``size`` entries (linear time) where that is not much more than ``coord``."""
    if size > 4 * int(coord.numel()) + 4096:
        return torch.unique(coord, sorted=True, return_inverse=True)
    seen = torch.zeros(size, dtype=torch.bool, device=_CPU)
    seen[coord] = True
    rank = torch.cumsum(seen, 0) - 1
    return seen.nonzero().reshape(-1), rank[coord]


def _arange(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64, device=_CPU)


def element_local(roots: Sequence[Node]) -> bool:
    """True when a region of these values costs about that region (no whole evaluation)."""
    for node in iter_nodes(roots):
        if isinstance(node, (Whole, Item)):
            return False
        if isinstance(node, Random) and not node.element_local:
            return False
    return True


class Evaluator:
    """Evaluates nodes with the draws keyed by ``keys`` (a draw without a key cannot be evaluated).

    Whole evaluations of non-local nodes are cached for the evaluator's lifetime.
    """

    def __init__(self, keys: Mapping[Random, Key], *, why_unkeyed: Optional[str] = None) -> None:
        self.keys = keys
        self.why_unkeyed = why_unkeyed
        self._cache: dict[int, tuple[Node, object]] = {}

    # ------------------------------------------------------------------ keys
    def key(self, node: Random) -> Key:
        if node.unkeyable is not None:
            raise UnkeyedRandomnessError(f"{node.site}: {node.unkeyable}")
        key = self.keys.get(node)
        if key is None:
            raise UnkeyedRandomnessError(
                f"{node.site}: init code {self.why_unkeyed or 'needs the values of a random draw'} "
                f"({node.what}); a draw's values are known only when keyinit has keyed it (by the tensor it "
                f"ends up in and the seed, when the model is materialized), so code keyinit captures cannot "
                f"depend on them: give the tensors that code writes a rule, or run that code after "
                f"materialize (on the real values: torch's iterative pruning, for one)"
            )
        return key

    # ------------------------------------------------------------------ values at flat positions
    def at(self, node: Node, pos: torch.Tensor) -> torch.Tensor:
        """The values of ``node`` at row-major flat indices ``pos`` (1-D int64, CPU), as a 1-D tensor."""
        n = int(pos.numel())
        if isinstance(node, Const):
            return torch.full((n,), node.value, dtype=node.dtype, device=_CPU)
        if isinstance(node, Suppressed):
            return torch.zeros((n,), dtype=node.dtype, device=_CPU)
        if isinstance(node, Literal):
            return node.tensor.reshape(-1)[pos] if node.shape else node.tensor.reshape(1).expand(n).clone()
        if isinstance(node, Random):
            return self._random_at(node, pos)
        if isinstance(node, Pointwise):
            return self._pointwise_at(node, pos)
        if isinstance(node, Cat):
            return self._cat_at(node, pos)
        if isinstance(node, Read):
            g = node.geometry
            spos = pos if g.is_identity(root_of(node.version).storage.numel) else g.positions(pos)
            return self.storage_at(node.version, spos, node.dtype)
        if isinstance(node, (Whole, Item)):
            return self.full(node).reshape(-1)[pos]
        raise TypeError(f"internal: cannot evaluate {type(node).__name__}")

    def _random_at(self, node: Random, pos: torch.Tensor) -> torch.Tensor:
        key = self.key(node)
        n = int(pos.numel())
        if node.by_index:
            out = torch.empty(n, dtype=node.dtype, device=_CPU)
            run_fill(node.fill, key, Target(node.what, make_region((max(node.numel, 1),), (pos,)), out))
            return out
        if not node.element_local or not node.shape:
            return self.full(node).reshape(-1)[pos]
        # Fans depend on the shape: draw a box of the shape that holds the positions (an element's
        # value depends only on the key, the shape and its index, not on the box it is drawn in).
        first = _run_start(pos)
        if first is not None:
            values = self._random_run(node, first, n)
            if values is not None:
                return values
        coords = unravel(pos, node.shape)
        uniques, inverses = [], []
        for coord, size in zip(coords, node.shape):
            unique, inverse = _unique_inverse(coord, size)
            uniques.append(unique)
            inverses.append(inverse)
        if math.prod(int(u.numel()) for u in uniques) > 4 * n + 4096:
            return self.full(node).reshape(-1)[pos]
        region = make_region(node.shape, tuple(uniques))
        out = torch.empty(region.region_shape, dtype=node.dtype, device=_CPU)
        run_fill(node.fill, key, Target(node.what, region, out))
        return out.reshape(-1)[ravel(inverses, region.region_shape)]

    def _random_run(self, node: Random, first: int, n: int) -> Optional[torch.Tensor]:
        """A shaped, element-local draw at the run ``[first, first + n)`` (a whole tensor, a row
        shard, a part of a cat), drawn as the whole rows that hold it; ``None`` when those rows are
        much more than the run."""
        row = math.prod(node.shape[1:])
        low, high = first // row, (first + n - 1) // row + 1
        if (high - low) * row > 4 * n + 4096:
            return None
        region = make_region(node.shape, (range(low, high),) + tuple(range(s) for s in node.shape[1:]))
        out = torch.empty(region.region_shape, dtype=node.dtype, device=_CPU)
        run_fill(node.fill, self.key(node), Target(node.what, region, out))
        return out.reshape(-1)[first - low * row:first - low * row + n]

    def run(self, node: Node, first: int, n: int) -> torch.Tensor:
        """``at(node, positions first .. first + n - 1)``, without building the positions where a
        run of the node is a run of its input (a cat's parts, a read of a whole buffer, a draw)."""
        if n > 0:
            if isinstance(node, Cat):
                return self._cat_run(node, first, n)
            if isinstance(node, Read) and node.geometry.is_identity(root_of(node.version).storage.numel):
                version = node.version  # as storage_at: a latest write that covers the buffer in order
                if isinstance(version, Write) and version.geometry.is_identity(root_of(version).storage.numel):
                    return self.run(version.value, first, n)
            # (an evaluator that draws its own way, overriding _random_at, keeps its way)
            if isinstance(node, Random) and node.element_local and node.shape and not node.by_index and \
                    type(self)._random_at is Evaluator._random_at:
                values = self._random_run(node, first, n)
                if values is not None:
                    return values
        return self.at(node, torch.arange(first, first + n, dtype=torch.int64, device=_CPU))

    def _pointwise_at(self, node: Pointwise, pos: torch.Tensor) -> torch.Tensor:
        if node.exact:
            return self._apply(node, pos)
        if node.numel <= CALL:
            # Small (RoPE frequencies, norm scales): the whole node in one call, as eager torch
            # computes it, whatever region was asked for: the same bits as eager, on every rank.
            return self.full(node).reshape(-1)[pos]
        # Evaluate whole aligned blocks so every element runs the same code path.
        first = _run_start(pos)
        if first is not None:  # a run of consecutive positions (the common case): its blocks are a range
            low, high = first // BLOCK, (first + int(pos.numel()) + BLOCK - 1) // BLOCK
            blocks = torch.arange(low, high, dtype=torch.int64, device=_CPU)
            where = None
        else:
            blocks, where = torch.unique(torch.div(pos, BLOCK, rounding_mode="floor"), sorted=True,
                                         return_inverse=True)
        padded = (blocks.unsqueeze(1) * BLOCK + _arange(BLOCK)).reshape(-1).clamp_(max=max(node.numel - 1, 0))
        values = torch.cat([self._apply(node, padded[i:i + CALL]) for i in range(0, int(padded.numel()), CALL)]) \
            if padded.numel() else torch.empty(0, dtype=node.dtype, device=_CPU)
        if where is None:
            offset = first - int(blocks[0]) * BLOCK
            return values[offset:offset + int(pos.numel())]
        return values[where * BLOCK + pos % BLOCK]

    def _apply(self, node: Pointwise, pos: torch.Tensor) -> torch.Tensor:
        coords: Optional[list[torch.Tensor]] = None
        values = []
        for arg in node.args:
            if not arg.shape:  # 0-D inputs keep their own type-promotion role
                values.append(self.at(arg, torch.zeros(1, dtype=torch.int64, device=_CPU)).reshape(()))
                continue
            if tuple(arg.shape) == tuple(node.shape):  # not broadcast: the same flat positions
                values.append(self.at(arg, pos))
                continue
            if coords is None:
                coords = unravel(pos, node.shape)
            offset = len(node.shape) - len(arg.shape)
            arg_coords = [coords[offset + d] if size != 1 else torch.zeros_like(pos)
                          for d, size in enumerate(arg.shape)]
            values.append(self.at(arg, ravel(arg_coords, arg.shape)))
        result = node.fn(*values)
        if result.dtype != node.dtype:
            raise TypeError(f"internal: {node.name} gave {result.dtype}, expected {node.dtype}")
        result = result.reshape(-1)
        return result.expand(int(pos.numel())) if result.numel() == 1 else result

    def _cat_at(self, node: Cat, pos: torch.Tensor) -> torch.Tensor:
        first = _run_start(pos)
        if first is not None:
            return self._cat_run(node, first, int(pos.numel()))
        coords = unravel(pos, node.shape)
        along = coords[node.dim]
        sizes = [1 if node.stack else arg.shape[node.dim] for arg in node.args]
        starts = torch.tensor([0] + list(_cumsum(sizes))[:-1], dtype=torch.int64, device=_CPU)
        which = torch.searchsorted(starts, along, right=True) - 1
        out = torch.empty(int(pos.numel()), dtype=node.dtype, device=_CPU)
        for i, arg in enumerate(node.args):
            hit = (which == i).nonzero().reshape(-1)
            if not hit.numel():
                continue
            local = [c[hit] for c in coords]
            if node.stack:
                del local[node.dim]
            else:
                local[node.dim] = local[node.dim] - int(starts[i])
            flat = ravel(local, arg.shape) if arg.shape else torch.zeros_like(hit)
            out[hit] = self.at(arg, flat).to(node.dtype)
        return out

    def _cat_run(self, node: Cat, first: int, n: int) -> torch.Tensor:
        """``node`` at the run ``[first, first + n)``: each part's elements in it are a run of
        the part's own flat indices (a cat keeps each part's row-major order), evaluated as one."""
        inner = math.prod(node.shape[node.dim + 1:])
        span = node.shape[node.dim] * inner  # elements of one index of the dims before ``dim``
        aligned = first % span == 0 and n % span == 0  # whole outer indices: each part a column block
        out = None if aligned else torch.empty(n, dtype=node.dtype, device=_CPU)
        columns = []
        start = 0
        for arg in node.args:
            size = 1 if node.stack else arg.shape[node.dim]
            block, offset = size * inner, start * inner  # the part's elements per outer index, where
            start += size
            if not block:
                continue
            low, high = _part_below(first, span, block, offset), _part_below(first + n, span, block, offset)
            if low == high:
                continue
            values = self.run(arg, low, high - low).to(node.dtype)
            if out is None:
                columns.append(values.view(-1, block))
                continue
            flat = torch.arange(low, high, dtype=torch.int64, device=_CPU)
            out[torch.div(flat, block, rounding_mode="floor") * span + (flat % block) + (offset - first)] = values
        return torch.cat(columns, dim=1).reshape(-1) if out is None else out

    def storage_at(self, version: Version, spos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The buffer's values at positions ``spos`` as of ``version``."""
        out = torch.empty(int(spos.numel()), dtype=dtype, device=_CPU)
        pending = _arange(int(spos.numel()))
        if isinstance(version, Write) and version.geometry.is_identity(root_of(version).storage.numel):
            return self.at(version.value, spos)  # the latest write covers the buffer in order
        while pending.numel():
            if isinstance(version, Alloc):
                raise UninitializedRead(
                    f"init code reads {int(pending.numel())} element(s) of {version.storage.label} that nothing wrote"
                )
            covered, flat = version.geometry.inverse(spos[pending])
            if bool(covered.any()):
                hit = pending[covered]
                out[hit] = self.at(version.value, flat[covered])
                pending = pending[~covered]
            version = version.prev
        return out

    # ------------------------------------------------------------------ whole values
    def full(self, node: Node) -> torch.Tensor:
        """The whole value of ``node`` (cached for non-local nodes)."""
        cached = self._cache.get(id(node))
        if cached is not None and cached[0] is node:
            return cached[1]  # type: ignore[return-value]
        value = self._full(node)
        if isinstance(node, (Whole, Item)) or (isinstance(node, Random) and not node.element_local) or \
                (isinstance(node, Pointwise) and not node.exact and node.numel <= CALL):
            self._cache[id(node)] = (node, value)
        return value

    def _full(self, node: Node) -> torch.Tensor:
        if isinstance(node, Whole):
            return self._whole(node)
        if isinstance(node, Item):
            result = self._whole(node.whole)
            return result[node.index]
        if isinstance(node, Random):
            out = torch.empty(node.shape, dtype=node.dtype, device=_CPU)
            run_fill(node.fill, self.key(node), Target(node.what, make_region(node.shape, None), out))
            return out
        if isinstance(node, Literal):
            return node.tensor.contiguous()
        if isinstance(node, Read):
            buffer, written = self.storage_full(node.version)
            g = node.geometry
            if written is not None and not bool(written.as_strided(g.size, g.stride, g.offset).all()):
                raise UninitializedRead(f"init code reads elements of {_label(node.version)} that nothing wrote")
            return buffer.as_strided(g.size, g.stride, g.offset).contiguous()
        if isinstance(node, Pointwise) and not node.exact and node.numel <= CALL:
            return self._apply(node, _arange(node.numel)).reshape(node.shape)
        return self.at(node, _arange(node.numel)).reshape(node.shape)

    def _whole(self, node: Whole) -> object:
        cached = self._cache.get(id(node))
        if cached is not None and cached[0] is node:
            return cached[1]
        result = node.fn(*[self.full(arg) for arg in node.args])
        self._cache[id(node)] = (node, result)
        return result

    def storage_full(self, version: Version) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The whole buffer as of ``version``, and a mask of written elements (None: all written)."""
        chain = []
        while isinstance(version, Write):
            chain.append(version)
            version = version.prev
        storage = version.storage
        chain.reverse()
        buffer = torch.empty(storage.numel, dtype=storage.dtype, device=_CPU)
        for write in chain:
            g = write.geometry
            buffer.as_strided(g.size, g.stride, g.offset).copy_(self.full(write.value))
        written = written_mask(chain, storage.numel)
        return buffer, (None if bool(written.all()) else written)


def _part_below(p: int, span: int, block: int, offset: int) -> int:
    """How many elements of a cat's part (``block`` elements at ``offset`` in every ``span``
    of the output) lie at output positions below ``p``."""
    return (p // span) * block + min(max(p % span - offset, 0), block)


def _label(version: Version) -> str:
    while isinstance(version, Write):
        version = version.prev
    return version.storage.label


def _cumsum(values: Sequence[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


# --------------------------------------------------------------------------- writing a target


def _write_chunks(evaluator: Evaluator, node: Node, target: Target) -> None:
    """``target.out`` = ``node`` at the target's region, evaluated on the CPU in chunks."""
    region = target.region
    out = target.out
    flat_out = out.reshape(-1) if out.is_contiguous() else None
    base = _region_run_start(region)
    for start, stop in region.chunks(CHUNK):
        values = evaluator.at(node, region.flat_indices(start, stop)) if base is None else \
            evaluator.run(node, base + start, stop - start)
        if flat_out is not None:
            flat_out[start:stop].copy_(values)
        else:
            _scatter(out, start, stop, values)


def _region_run_start(region) -> Optional[int]:
    """The global flat index of the region's first element if its elements are consecutive
    global positions in row-major order (leading single indices, one range, whole trailing
    dims: a whole tensor or a row shard), else ``None``."""
    base, whole_tail = 0, True
    for entry, size, stride in zip(reversed(region.entries), reversed(region.shape), reversed(region.strides)):
        if not isinstance(entry, range) or (entry.step != 1 and len(entry) > 1):
            return None
        if not whole_tail and len(entry) > 1:
            return None
        if len(entry):
            base += entry.start * stride
        whole_tail = whole_tail and len(entry) == size
    return base


def _scatter(out: torch.Tensor, start: int, stop: int, values: torch.Tensor) -> None:
    coords = unravel(_arange(stop - start) + start, tuple(out.shape))
    out[tuple(c.to(out.device) for c in coords)] = values.to(device=out.device, dtype=out.dtype)


def _base_write(evaluator: Evaluator, write: Write, program: SlotProgram, target: Target) -> None:
    value = write.value
    if write.geometry == StridedView.contiguous(program.shape):
        if isinstance(value, Random) and value.shape == program.shape:
            out = target.out
            if out.dtype.is_floating_point and out.dtype.itemsize == 1 and value.dtype != out.dtype:
                # float8 (a model cast after construction): no sampler draws it, so draw in the
                # record's dtype and round, as eager torch casts the built values
                wide = torch.empty(out.shape, dtype=value.dtype, device=out.device)
                run_fill(value.fill, evaluator.key(value), attrs.evolve(target, out=wide))
                out.copy_(wide)
                return
            run_fill(value.fill, evaluator.key(value), target)  # the fast kernels, on the target's device
        elif isinstance(value, Const):
            target.out.fill_(value.value)
        else:
            _write_chunks(evaluator, value, target)
        return
    # A full write through a permuted view (e.g. ``w.T.copy_(x)``): read it back through the buffer.
    _write_chunks(evaluator, Read(write, StridedView.contiguous(program.shape), program.dtype), target)


def _partial_write(evaluator: Evaluator, write: Write, program: SlotProgram, target: Target) -> None:
    region = target.region
    structure = write.geometry.structure(program.shape)
    if structure is None:
        _partial_write_general(evaluator, write, target)
        return
    local, view_coord = [], []
    for d, (start, step, count, _view_dim) in enumerate(structure):
        indices = region.indices[d]
        rel = indices - start
        if step == 0:
            hit = rel == 0
        else:
            hit = (rel >= 0) & (rel % step == 0) & (torch.div(rel, step, rounding_mode="floor") < count)
        where = hit.nonzero().reshape(-1)
        if not where.numel():
            return
        local.append(where)
        view_coord.append(torch.div(rel[where], step, rounding_mode="floor") if step else torch.zeros_like(where))
    view_strides = row_major_strides(write.geometry.size)
    shape = tuple(int(w.numel()) for w in local)
    vfirst = _view_run(structure, view_coord, write.geometry.size) if shape else None
    if vfirst is not None:  # the elements written here are consecutive elements of the view
        values = evaluator.run(write.value, vfirst, math.prod(shape)).reshape(shape)
    else:
        vpos = torch.zeros(shape, dtype=torch.int64, device=_CPU)
        for d, (_start, _step, _count, view_dim) in enumerate(structure):
            if view_dim is None:
                continue
            index_shape = [1] * len(shape)
            index_shape[d] = shape[d]
            vpos = vpos + view_coord[d].reshape(index_shape) * view_strides[view_dim]
        values = evaluator.at(write.value, vpos.reshape(-1)).reshape(shape)
    out = target.out
    if not shape:
        out.copy_(values.reshape(()))
        return
    starts = [_run_start(where) for where in local]
    if all(start is not None for start in starts):  # a box of the target: slices, not index tensors
        box = tuple(slice(start, start + size) for start, size in zip(starts, shape))
        out[box] = values.to(device=out.device, dtype=out.dtype)
        return
    index = []
    for d, where in enumerate(local):
        index_shape = [1] * len(shape)
        index_shape[d] = shape[d]
        index.append(where.reshape(index_shape).to(out.device))
    out[tuple(index)] = values.to(device=out.device, dtype=out.dtype)


def _view_run(structure: list, view_coord: list, size: tuple[int, ...]) -> Optional[int]:
    """The row-major index in the view of size ``size`` of the first element a partial write
    touches, if the touched elements (buffer dims in order) are consecutive elements of the view,
    else ``None``: each view dim's coordinates a run, the view dims in buffer-dim order, and
    every view dim after the first one touched more than once whole."""
    runs = {}
    order = []
    for d, (_start, _step, _count, view_dim) in enumerate(structure):
        if view_dim is None:
            continue
        first = _run_start(view_coord[d])
        if first is None or (order and view_dim < order[-1]):
            return None
        runs[view_dim] = (first, int(view_coord[d].numel()))
        order.append(view_dim)
    vfirst, whole_tail = 0, True
    for k in reversed(range(len(size))):
        first, count = runs.get(k, (0, 1))
        if count > 1 and not whole_tail:
            return None
        vfirst += first * row_major_strides(size)[k]
        whole_tail = whole_tail and count == size[k]
    return vfirst


def _partial_write_general(evaluator: Evaluator, write: Write, target: Target) -> None:
    region = target.region
    out = target.out
    for start, stop in region.chunks(CHUNK):
        covered, flat = write.geometry.inverse(region.flat_indices(start, stop))
        if not bool(covered.any()):
            continue
        hit = covered.nonzero().reshape(-1)
        values = evaluator.at(write.value, flat[hit])
        coords = unravel(hit + start, tuple(out.shape)) if out.dim() else []
        if out.dim():
            out[tuple(c.to(out.device) for c in coords)] = values.to(device=out.device, dtype=out.dtype)
        else:
            out.copy_(values.reshape(()))


def write_target(evaluator: Evaluator, program: SlotProgram, target: Target) -> None:
    """Write ``program``'s values at ``target.region`` into ``target.out``."""
    if target.out.numel() == 0:
        return
    with torch.no_grad():
        if program.read is not None:
            _write_chunks(evaluator, program.read, target)
            return
        if not program.writes:
            raise UninitializedRead(f"{program.fqn}: nothing writes this tensor")
        writes = program.writes
        if program.complete and writes[0].geometry.covers_buffer(math.prod(program.shape)):
            _base_write(evaluator, writes[0], program, target)
            writes = writes[1:]
        # Otherwise the tensor is written in pieces (``w[:4].normal_(); w[4:].zero_()``), or some
        # elements are never written and keep the target's current values: each write touches
        # only the part of the region it covers, in program order.
        for write in writes:
            _partial_write(evaluator, write, program, target)
