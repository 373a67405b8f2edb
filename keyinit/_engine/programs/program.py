"""Programs: what captured init code does to a tensor, as a small graph over global indices.

Capture (:mod:`keyinit._engine.capture.capture`) runs existing init code on stand-ins and records,
for every tensor, a *program*: a chain of writes into a flat buffer (a
:class:`Storage`), each write putting the values of a *node* into the elements
a strided *geometry* selects. Nodes are immutable values:

- :class:`Const` (``fill_``, ``zeros``), :class:`Literal` (a tensor computed
  outside the model, such as a sinusoid table);
- :class:`Random`: a draw, keyed later by where it lands (see :func:`assign_keys`);
- :class:`Pointwise` (element-wise ops, dtype conversions, broadcasting),
  :class:`Cat` (``cat``/``stack``), :class:`Read` (the values of a view of a
  buffer at one moment);
- :class:`Whole`: any other op (reductions, QR, matmul, indexing writes),
  which is evaluated on whole inputs; :class:`Item` picks one of its outputs.

Every node denotes a dense tensor of ``shape`` and ``dtype``; element ``i`` (row-major)
is what the init code would have put there on one device. :mod:`keyinit._engine.programs.replay`
evaluates any set of elements of any node. Fills, views, element-wise ops and
``cat`` are *element-local*: producing a region costs that region. The rest is
evaluated whole, still keyed, so it is still layout-invariant.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional, Union

import attrs
import torch

from keyinit.keys import Key, fold_in, key_for
from keyinit.regions import row_major_strides

__all__ = [
    "StridedView",
    "Node",
    "Const",
    "Literal",
    "Random",
    "Pointwise",
    "Cat",
    "Whole",
    "Item",
    "Read",
    "Suppressed",
    "Alloc",
    "Write",
    "Version",
    "Storage",
    "SlotProgram",
    "random_nodes",
    "assign_keys",
]


def unravel(flat: torch.Tensor, shape: Sequence[int]) -> list[torch.Tensor]:
    """Row-major coordinates of flat indices ``flat`` in ``shape`` (one int64 tensor per dim)."""
    coords = []
    rest = flat
    for size in reversed(tuple(shape)):
        if size == 1:
            coords.append(torch.zeros_like(rest))
        else:
            coords.append(rest % size)
            rest = rest // size
    return list(reversed(coords))


def ravel(coords: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """Row-major flat index of coordinates ``coords`` in ``shape``."""
    flat: Optional[torch.Tensor] = None
    for coord, stride in zip(coords, row_major_strides(shape)):
        term = coord * stride
        flat = term if flat is None else flat + term
    if flat is None:  # 0-D
        raise ValueError("ravel of a 0-D shape needs no coordinates")
    return flat


# --------------------------------------------------------------------------- geometry


@attrs.frozen
class StridedView:
    """A strided view of a flat buffer: element ``m`` (a coordinate of ``size``) is buffer
    position ``offset + sum_k m[k] * stride[k]``, as ``torch.as_strided``."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def contiguous(cls, shape: Sequence[int]) -> "StridedView":
        return cls(tuple(shape), row_major_strides(shape), 0)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "StridedView":
        return cls(tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset()))

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def positions(self, flat: torch.Tensor) -> torch.Tensor:
        """Buffer positions of the view's elements at row-major indices ``flat``."""
        pos = torch.full_like(flat, self.offset)
        for coord, stride in zip(unravel(flat, self.size), self.stride):
            pos += coord * stride
        return pos

    def _nested_dims(self) -> Optional[list[int]]:
        """Dims (size > 1) by decreasing stride, if each stride exceeds the span of the smaller
        ones: then the view is injective and a buffer position has at most one coordinate,
        found greedily. ``None`` otherwise (overlapping or interleaved views)."""
        dims = sorted((d for d, s in enumerate(self.size) if s > 1), key=lambda d: -self.stride[d])
        span = 0
        for d in reversed(dims):
            if self.stride[d] <= span:
                return None
            span += self.stride[d] * (self.size[d] - 1)
        return dims

    def inverse(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(covered, flat)``: which buffer positions the view holds, and at which row-major index."""
        if self.numel == 0:
            return torch.zeros_like(pos, dtype=torch.bool), torch.zeros_like(pos)
        dims = self._nested_dims()
        view_strides = row_major_strides(self.size)
        if dims is not None:
            rest = pos - self.offset
            covered = rest >= 0
            flat = torch.zeros_like(pos)
            for d in dims:
                coord = torch.div(rest, self.stride[d], rounding_mode="floor")
                covered &= (coord >= 0) & (coord < self.size[d])
                rest = rest - coord * self.stride[d]
                flat += coord * view_strides[d]
            covered &= rest == 0
            return covered, torch.where(covered, flat, torch.zeros_like(flat))
        # General view: enumerate its positions (O(numel) once), then look buffer positions up.
        every = self.positions(torch.arange(self.numel, dtype=torch.int64, device="cpu"))
        order = torch.argsort(every, stable=True)
        ordered = every[order]
        slot = torch.searchsorted(ordered, pos).clamp(max=ordered.numel() - 1)
        covered = ordered[slot] == pos
        return covered, torch.where(covered, order[slot], torch.zeros_like(pos))

    def is_identity(self, numel: int) -> bool:
        """True when the view is a whole buffer of ``numel`` elements in row-major order
        (its element ``i`` is buffer position ``i``)."""
        return self.offset == 0 and self.numel == numel and all(
            st == want for s, st, want in zip(self.size, self.stride, row_major_strides(self.size)) if s > 1)

    def covers_buffer(self, numel: int) -> bool:
        """True when the view holds every position of a buffer of ``numel`` elements, once."""
        if self.numel != numel:
            return False
        if numel == 0:
            return True
        if self._nested_dims() is None:
            return False
        span = sum(st * (s - 1) for s, st in zip(self.size, self.stride))
        return self.offset == 0 and span == numel - 1

    def structure(self, shape: Sequence[int]) -> Optional[list[tuple[int, int, int, Optional[int]]]]:
        """The view as a progression per dim of a contiguous buffer of ``shape``, if it is one.

        Returns ``[(start, step, count, view_dim), ...]`` per buffer dim (``view_dim`` None
        for a dim the view fixes at ``start``): slices, ``select``, ``narrow``, transposes,
        permutes and ``unsqueeze`` are such views. ``None`` for anything else.
        """
        shape = tuple(shape)
        if not shape:
            return [] if self.numel == 1 and self.offset == 0 else None
        base = row_major_strides(shape)
        starts = [(self.offset // b) % s if s > 0 else 0 for b, s in zip(base, shape)]
        if sum(st * b for st, b in zip(starts, base)) != self.offset:
            return None
        out: list[tuple[int, int, int, Optional[int]]] = [(st, 0, 1, None) for st in starts]
        used: set[int] = set()
        for k, (size, stride) in enumerate(zip(self.size, self.stride)):
            if size == 1:
                continue
            if size == 0:
                return None
            chosen = None
            for d in range(len(shape)):
                if d in used or shape[d] <= 1 or stride <= 0 or stride % base[d]:
                    continue
                step = stride // base[d]
                if starts[d] + step * (size - 1) < shape[d]:
                    chosen = (d, step)
                    break
            if chosen is None:
                return None
            d, step = chosen
            used.add(d)
            out[d] = (starts[d], step, size, k)
        return out


# --------------------------------------------------------------------------- nodes


class Node:
    """A dense tensor value of ``shape`` and ``dtype`` (see the module docstring)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def inputs(self) -> tuple["Node", ...]:
        return ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@attrs.frozen(eq=False)
class Const(Node):
    """Every element is ``value``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    value: Union[bool, int, float]


@attrs.frozen(eq=False)
class Literal(Node):
    """A tensor computed outside the captured graph (CPU, any strides)."""

    tensor: torch.Tensor = attrs.field(repr=False)
    shape: tuple[int, ...] = attrs.field(init=False)
    dtype: torch.dtype = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.tensor.shape))
        object.__setattr__(self, "dtype", self.tensor.dtype)


@attrs.frozen(eq=False)
class Random(Node):
    """A keyed draw: ``fill(key, target)`` writes the values of a region of a ``shape`` tensor
    (a :mod:`keyinit.init` initializer, or a :mod:`keyinit.random` sampler).

    ``by_index`` says the values depend only on each element's flat index (not on ``shape``,
    as fans do), so any set of elements can be drawn as a 1-D region. ``key`` is not known
    at capture: :func:`assign_keys` assigns it from where the draw lands. ``site`` names the
    code that drew it; ``unkeyable`` says why it cannot be keyed (raised if it is ever needed).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    what: str
    site: str
    fill: Optional[Callable[[Key, Any], None]] = None
    by_index: bool = False
    element_local: bool = True
    unkeyable: Optional[str] = None


@attrs.frozen(eq=False)
class Suppressed(Node):
    """The value of an op inside an init function keyinit replaced whole (never read for real)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@attrs.frozen(eq=False)
class Pointwise(Node):
    """``fn(*inputs)`` element by element; inputs broadcast to ``shape`` (0-D inputs stay 0-D).

    ``exact`` marks data movement and dtype conversion, whose bits never depend on how the
    elements are batched; other element-wise math is evaluated in aligned blocks (see
    :mod:`keyinit._engine.programs.replay`) so vectorized and scalar code paths cannot differ by layout.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    fn: Callable[..., torch.Tensor] = attrs.field(repr=False)
    args: tuple[Node, ...] = attrs.field(repr=False)
    name: str
    exact: bool = False

    @property
    def inputs(self) -> tuple[Node, ...]:
        return self.args


@attrs.frozen(eq=False)
class Cat(Node):
    """``torch.cat(args, dim)`` (``stack=False``) or ``torch.stack(args, dim)`` (``stack=True``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple[Node, ...] = attrs.field(repr=False)
    dim: int
    stack: bool = False

    @property
    def inputs(self) -> tuple[Node, ...]:
        return self.args


@attrs.frozen(eq=False)
class Whole(Node):
    """``fn(*whole inputs)``: any op that is not element-local; it may return a tuple, whose
    parts :class:`Item` selects. ``shape``/``dtype`` describe a single-tensor result."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fn: Callable[..., Any] = attrs.field(repr=False)
    args: tuple[Node, ...] = attrs.field(repr=False)
    name: str

    @property
    def inputs(self) -> tuple[Node, ...]:
        return self.args


@attrs.frozen(eq=False)
class Item(Node):
    """Output ``index`` of a multi-output :class:`Whole`."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    whole: Whole = attrs.field(repr=False)
    index: int

    @property
    def inputs(self) -> tuple[Node, ...]:
        return (self.whole,)


@attrs.frozen(eq=False)
class Alloc:
    """A buffer before any write (reading it is an error: uninitialized memory)."""

    storage: "Storage"


@attrs.frozen(eq=False)
class Write:
    """The buffer after ``prev``, with ``value`` written into the elements of ``geometry``."""

    prev: "Version" = attrs.field(repr=False)
    geometry: StridedView
    value: Node = attrs.field(repr=False)
    label: str


Version = Union[Alloc, Write]


@attrs.frozen(eq=False)
class Read(Node):
    """The values a view of a buffer held at one moment (``version``)."""

    version: Version = attrs.field(repr=False)
    geometry: StridedView
    dtype: torch.dtype
    shape: tuple[int, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "shape", self.geometry.size)

    @property
    def inputs(self) -> tuple[Node, ...]:
        return tuple(write.value for write in writes_of(self.version))


@attrs.define(eq=False)
class Storage:
    """A flat buffer during capture: ``current`` is its latest version (mutable, capture only)."""

    numel: int
    dtype: torch.dtype
    label: str
    current: Version = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.current is None:
            self.current = Alloc(self)

    def write(self, geometry: StridedView, value: Node, label: str) -> None:
        if value.dtype != self.dtype:
            raise TypeError(f"internal: {value.dtype} value written into a {self.dtype} buffer")
        if tuple(value.shape) != geometry.size:
            raise ValueError(f"internal: value of shape {value.shape} written into a view of {geometry.size}")
        self.current = Write(self.current, geometry, value, label)


def writes_of(version: Version) -> list[Write]:
    """The writes of a version chain, oldest first."""
    chain = []
    while isinstance(version, Write):
        chain.append(version)
        version = version.prev
    chain.reverse()
    return chain


def root_of(version: Version) -> Alloc:
    while isinstance(version, Write):
        version = version.prev
    return version


# --------------------------------------------------------------------------- programs of model tensors


@attrs.frozen(eq=False)
class SlotProgram:
    """The program of one model tensor of global ``shape``.

    ``writes`` are the writes of its buffer (a contiguous buffer of ``shape``) from the last
    write that covers the whole buffer on (earlier writes are dead), oldest first.
    ``read`` is set instead when the init code re-assigned the tensor (``self.cache = ...``):
    the value is that node. ``complete`` says every element is written.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    writes: tuple[Write, ...] = ()
    read: Optional[Node] = None
    complete: bool = True
    history: tuple[Write, ...] = ()  # every write of the buffer, dead ones included

    @classmethod
    def of_storage(cls, fqn: str, shape: tuple[int, ...], storage: Storage) -> "SlotProgram":
        chain = writes_of(storage.current)
        start = 0
        for i, write in enumerate(chain):
            if write.geometry.covers_buffer(storage.numel):
                start = i
        live = tuple(chain[start:])
        complete = bool(live) and live[0].geometry.covers_buffer(storage.numel)
        if not complete and live:
            complete = writes_cover(live, shape)
        return cls(fqn, tuple(shape), storage.dtype, live, None, complete or storage.numel == 0, tuple(chain))

    @property
    def source(self) -> Optional[str]:
        """The label of the last write (what wrote this tensor last)."""
        writes = writes_of(self.read.version) if isinstance(self.read, Read) else self.writes
        return writes[-1].label if writes else None

    @property
    def empty(self) -> bool:
        return self.read is None and not self.writes

    def roots(self) -> list[Node]:
        """The value nodes this program is made of, in program order."""
        if self.read is not None:
            return [self.read]
        return [write.value for write in self.writes]


#: Buffers up to this many elements are checked with a mask of every element; larger ones by
#: the boxes their writes cover (memory proportional to the program), or in bounded chunks.
MASK_LIMIT = 1 << 24


def writes_cover(writes: Sequence[Write], shape: Sequence[int]) -> bool:
    """Whether ``writes`` together write every element of a contiguous buffer of ``shape``.

    Costs memory proportional to the program, not to the buffer: small buffers use a mask;
    writes through box views of ``shape`` (slices, ``narrow``, ``select``) are checked on the
    grid their bounds cut the buffer into; anything else in bounded chunks."""
    numel = math.prod(shape)
    if any(write.geometry.covers_buffer(numel) for write in writes):
        return True
    if numel <= MASK_LIMIT:
        return bool(written_mask(writes, numel).all())
    boxes = []
    for write in writes:
        structure = write.geometry.structure(shape)
        if structure is None or any(step not in (0, 1) for _start, step, _count, _dim in structure):
            return _cover_in_chunks(writes, numel)
        boxes.append([(start, start + (count if step else 1)) for start, step, count, _dim in structure])
    return _boxes_cover(tuple(shape), boxes)


def _boxes_cover(shape: tuple[int, ...], boxes: list[list[tuple[int, int]]]) -> bool:
    """Whether boxes (``[(start, stop)]`` per dim) cover ``shape``: marked on the grid of their bounds."""
    cuts = [sorted({0, size} | {b for box in boxes for b in box[d]}) for d, size in enumerate(shape)]
    grid = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.bool)
    for box in boxes:
        index = tuple(slice(c.index(lo), c.index(hi)) for c, (lo, hi) in zip(cuts, box))
        grid[index] = True
    return bool(grid.all())


def _cover_in_chunks(writes: Sequence[Write], numel: int, chunk: int = 1 << 22) -> bool:
    for start in range(0, numel, chunk):
        pos = torch.arange(start, min(start + chunk, numel), dtype=torch.int64)
        covered = torch.zeros(pos.numel(), dtype=torch.bool)
        for write in writes:
            covered |= write.geometry.inverse(pos)[0]
        if not bool(covered.all()):
            return False
    return True


def written_mask(writes: Sequence[Write], numel: int) -> torch.Tensor:
    """Which of a buffer's ``numel`` elements ``writes`` write (a bool tensor)."""
    mask = torch.zeros(numel, dtype=torch.bool, device="cpu")
    for write in writes:
        g = write.geometry
        mask.as_strided(g.size, g.stride, g.offset).fill_(True)
    return mask


# --------------------------------------------------------------------------- keys


def iter_nodes(roots: Sequence[Node]) -> Iterator[Node]:
    """Every node reachable from ``roots``, depth-first in input order, each once."""
    seen: set[int] = set()
    stack: list[Any] = list(reversed(roots))
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(reversed(node.inputs))


def random_nodes(program: SlotProgram) -> list[Random]:
    """The draws a program depends on, in program order (depth first, first visit)."""
    return [node for node in iter_nodes(program.roots()) if isinstance(node, Random)]


def own_fill(program: SlotProgram, reachable: Sequence[Random]) -> Optional[Random]:
    """The draw that filled the whole tensor directly (``nn.init.normal_(w)``, ``w.data.uniform_()``),
    if the program still depends on one: the latest such fill (``normal_`` then ``div_`` by a norm
    depends on the ``normal_``)."""
    if program.read is not None:
        return None
    wanted = {id(node) for node in reachable}
    whole = StridedView.contiguous(program.shape)
    for write in reversed(program.history):
        value = write.value
        if isinstance(value, Random) and write.geometry == whole and value.shape == program.shape \
                and id(value) in wanted:
            return value
    return None


def assign_keys(programs: Sequence[tuple[SlotProgram, str]], root: Key) -> dict[Random, Key]:
    """Key every draw by where it lands.

    ``programs`` are ``(program, key_fqn)`` in model order. A draw that fills a whole model
    tensor directly gets ``key_for(root, key_fqn)`` (the key every rule would use); every other
    draw gets ``fold_in(key_for(root, key_fqn), position)``, where ``position`` is its index
    among the draws of that tensor's program in program order. A draw that lands in several
    tensors takes the key of the first of them in model order.
    """
    keys: dict[Random, Key] = {}
    for program, key_fqn in programs:
        draws = random_nodes(program)
        if not draws:
            continue
        base = key_for(root, key_fqn)
        whole = own_fill(program, draws)
        position = 0
        for draw in draws:
            if draw is whole:
                keys.setdefault(draw, base)
                continue
            keys.setdefault(draw, fold_in(base, position))
            position += 1
    return keys
