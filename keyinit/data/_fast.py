"""The common random ops of data pipelines, keyed without building a program.

:func:`plan` recognizes ``uniform_``, ``normal_``, ``rand``, ``randn``, ``rand_like``, ``randn_like``,
``randint``, ``random_``, ``bernoulli``/``bernoulli_`` (scalar or tensor ``p``) and ``randperm`` with
arguments the table of :mod:`keyinit._engine.random_ops` maps to plain samplers, and returns a
:class:`Recipe`: the draws the keyed equivalent makes (sampler, dtype, shape, in the order
:func:`keyinit._engine.keyed_op.keyed_op` numbers them) and how the result is made from them. The
values are those of the table, bit for bit: the same samplers, the same arithmetic; only the
meta run, the program nodes and the evaluator are skipped. Anything else (other ops, other
overloads, ``out=``, arguments the table refuses) is None, and callers take the general path.

:func:`fold` is ``keyinit.fold_in`` of an int or a str; with the CPU kernel library (:func:`fold_with`) the
Philox of a stream v1 derivation runs in C. :func:`fill_folded` writes a draw of a keyed op under
``fold_in(fold_in(key, call), draw)`` with the two folds and the fill in one C call, and
:meth:`Recipe.drawn` makes a recognized op's value that way, writing an in-place op's contiguous CPU
target directly.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any, Callable, Optional, Union

import torch
from torch.autograd.graph import increment_version

from keyinit._draw.dispatch import kernels_disabled
from keyinit._draw.geometry import coalesce
from keyinit._kernels.common.ids import DIST_IDS, DTYPE_IDS
from keyinit._kernels.fill.cpu import MIN_PARALLEL_ELEMENTS
from keyinit.distributions import FLOAT_DTYPES, INT_DTYPES, Bernoulli, Bits, Normal, Randint, Uniform
from keyinit.keys import Key, fold_in, fold_inputs
from keyinit.regions import make_region

__all__ = ["fold", "fold_str", "fold_with", "fold_words", "fill", "fill_folded", "plan", "Recipe"]



#: ``fold_in`` of an int and of a str (the names the fast path's callers use; one derivation: keys.fold_in).
fold = fold_in
fold_str = fold_in

_MASK32 = 0xFFFFFFFF


@functools.lru_cache(maxsize=64)
def _counter(data: Union[int, str]) -> tuple[int, int, int, int]:
    """The stream v1 Philox counter ``(x0, x1, tag, x3)`` of ``fold_in(K, data)`` (constant strings: remembered)."""
    tag, (x0, x1, x3) = fold_inputs(data)
    return x0, x1, tag, x3


def fold_words(lib: Any, parent: Key, data: Union[int, str]) -> tuple[int, int]:
    """The words of ``fold_in(parent, data)``; with the kernel library ``lib`` (not None) the Philox of a v1
    key runs in C."""
    if lib is not None and parent.stream == "v1":
        if type(data) is int and 0 <= data <= 0xFFFFFFFFFFFFFFFF:
            words = lib.keyinit_derive(parent.k0, parent.k1, data & _MASK32, data >> 32, 2, 0)
            return words & _MASK32, words >> 32
        if type(data) is str:
            words = lib.keyinit_derive(parent.k0, parent.k1, *_counter(data))
            return words & _MASK32, words >> 32
    return fold_in(parent, data).words  # fold_in says what is wrong with data


def fold_with(lib: Any, parent: Key, data: Union[int, str]) -> Key:
    """``fold_in(parent, data)``; with the kernel library ``lib`` (not None) the Philox of a v1 key runs in C."""
    if lib is None or parent.stream != "v1":
        return fold_in(parent, data)
    return Key(*fold_words(lib, parent, data), "v1")


@functools.lru_cache(maxsize=1024)
def folded(parent: Key, data: int) -> Key:
    """``fold_in(parent, data)``, remembered: the domain and epoch keys every sample of an epoch shares."""
    return fold_in(parent, data)


_LIBRARY: list = []  # the CPU kernel library once loaded (loading it checks it: milliseconds)


def kernel_library() -> Any:
    """The CPU fill kernel's library, or None where kernels are disabled (``KEYINIT_DISABLE_KERNELS``,
    read on every call) or unavailable (resolve once per keyed call)."""
    if kernels_disabled():
        return None
    if not _LIBRARY:
        from keyinit._kernels.fill.cpu import library

        lib = library()
        if lib is None:
            return None
        _LIBRARY.append(lib)
    return _LIBRARY[0]


@functools.lru_cache(maxsize=4096)
def draw_key(parent: Key, call: int, draw: int) -> Key:
    """``fold(fold(parent, call), draw)``, remembered: collate keys repeat for every batch of an epoch."""
    return fold(fold(parent, call), draw)


class Geometry:
    """Where a fill's elements lie in the stream: all of a contiguous ``out`` from flat index 0
    (``rows`` None), or row ``b`` of an ``(B, R)`` ``out`` from flat index ``rows[b] * row_stride``;
    the kernel's arguments are built once and reused for every draw of that geometry."""

    __slots__ = ("rows", "row_stride", "numel", "args")

    def __init__(self, shape: tuple[int, ...], rows: Optional[torch.Tensor] = None, row_stride: int = 0) -> None:
        self.rows, self.row_stride, self.numel = rows, row_stride, math.prod(shape)
        if rows is None:
            base, dims = 0, [[self.numel, 1, 1, None]]
        else:
            base, dims = coalesce([(shape[0], shape[1], row_stride, 0, rows), (shape[1], 1, 1, 0, None)])
        nd = len(dims)
        self.args = (nd, base, (ctypes.c_int64 * nd)(*(d[0] for d in dims)),
                     (ctypes.c_int64 * nd)(*(d[1] for d in dims)), (ctypes.c_int64 * nd)(*(d[2] for d in dims)),
                     (ctypes.c_void_p * nd)(*(None if d[3] is None else d[3].data_ptr() for d in dims)))


@functools.lru_cache(maxsize=64)
def _params(dist: Any) -> tuple:
    from keyinit._kernels.fill.cpu import kernel_params as params

    f, i = params(dist)
    return (ctypes.c_double * 6)(*f), (ctypes.c_int64 * 4)(*i)


@functools.lru_cache(maxsize=256)
def _kernel_args(dist: Any, dtype: torch.dtype) -> Optional[tuple]:
    """``(dist id, dtype id, fparams, iparams)`` of the fill kernel, or None where it has no such pair."""
    dist_id, dtype_id = DIST_IDS.get(type(dist)), DTYPE_IDS.get(dtype)
    if dist_id is None or dtype_id is None:
        return None
    return (dist_id, dtype_id) + _params(dist)


def fill_folded(lib: Any, out: torch.Tensor, dist: Any, key: Key, call: int, draw: int) -> None:
    """Write ``dist``'s values into ``out`` (a contiguous CPU tensor, written whole from flat index 0) under
    ``fold_in(fold_in(key, call), draw)``: the two folds and the fill in one C call (``lib``; v1 keys),
    else :func:`fill` under the key folded in Python. The version counter is the caller's to bump."""
    numel = out.numel()
    args = _kernel_args(dist, out.dtype) if lib is not None and key.stream == "v1" else None
    if args is None:
        fill(lib, out, dist, fold(fold(key, call), draw))
    elif numel:
        dist_id, dtype_id, fparams, iparams = args
        threads = 1 if numel < MIN_PARALLEL_ELEMENTS else max(1, torch.get_num_threads())
        rc = lib.keyinit_fill_folded(dist_id, dtype_id, key.k0, key.k1, call, draw, fparams, iparams, numel,
                                     out.data_ptr(), threads)
        if rc != 0:  # pragma: no cover - the arguments are those keyinit_fill accepts
            raise RuntimeError(f"keyinit_fill_folded failed with code {rc}")


def fill(lib: Any, out: torch.Tensor, dist: Any, key: Key, geometry: Optional[Geometry] = None) -> None:
    """Write ``dist``'s values into ``out`` (a new contiguous CPU tensor) at ``geometry`` (default: all
    of ``out`` from flat index 0) of ``key``'s stream.

    The values of ``keyinit._draw.dispatch.fill`` with the matching region (the kernel called directly,
    without building the region and its checks); the reference where ``lib`` is None.
    """
    numel = out.numel()
    if numel == 0:
        return
    args = _kernel_args(dist, out.dtype) if lib is not None and key.stream == "v1" else None
    if args is None:
        from keyinit._draw import dispatch as _dispatch

        if geometry is None or geometry.rows is None:
            region = make_region(tuple(out.shape), None)
        else:
            region = make_region(((1 << 62) // geometry.row_stride, geometry.row_stride),
                                 (geometry.rows, range(out.shape[1])))
        _dispatch.fill(out, dist, key, region)
        return
    if geometry is None:
        geometry = Geometry(tuple(out.shape))
    dist_id, dtype_id, fparams, iparams = args
    threads = 1 if numel < MIN_PARALLEL_ELEMENTS else max(1, torch.get_num_threads())
    rc = lib.keyinit_fill(dist_id, dtype_id, key.k0, key.k1, fparams, iparams, *geometry.args, out.data_ptr(),
                          threads)
    if rc != 0:  # pragma: no cover - the arguments are the ones _dispatch.fill would pass
        raise RuntimeError(f"keyinit_fill failed with code {rc}")


class Recipe:
    """What a recognized random op draws and how its result is made.

    ``draws``: ``(distribution, dtype, shape)`` per keyed draw ``j`` (None: a constant, no draw);
    ``finish(values)``: the op's value (CPU) from the drawn tensors; ``write``: the tensor an
    in-place op writes (None: the op returns a new tensor on ``device``).
    """

    __slots__ = ("shape", "draws", "finish", "write", "device")

    def __init__(self, shape: tuple[int, ...], draws: list, finish: Callable[[list], torch.Tensor],
                 write: Optional[torch.Tensor], device: Any) -> None:
        self.shape, self.draws, self.finish, self.write, self.device = shape, draws, finish, write, device

    def result(self, values: list) -> Any:
        value = self.finish(values)
        if self.write is not None:
            with torch.no_grad():
                self.write.copy_(value.to(self.write.device))
            return self.write
        if self.device is None or (type(self.device) is torch.device and self.device.type == "cpu"):
            return value  # .to(cpu) of a CPU tensor is the tensor itself
        return value.to(self.device)

    def drawn(self, lib: Any, key: Key, call: int) -> Any:
        """The op's value, its draw ``j`` under ``fold_in(fold_in(key, call), j)`` (:func:`fill_folded`).

        An in-place op whose one draw has its target's dtype, on a contiguous CPU tensor, is written
        straight into the target (no temporary and no copy; the version counter bumped as ``copy_``
        would); the values are those of :meth:`result` either way."""
        draws, write = self.draws, self.write
        if write is not None and self.finish is _first and type(write) is torch.Tensor and \
                write.dtype == draws[0][1] and write.is_cpu and write.is_contiguous() and \
                not write.is_inference():
            fill_folded(lib, write, draws[0][0], key, call, 0)
            increment_version(write)  # the write bypassed torch
            return write
        values: list = []
        j = 0
        for draw in draws:  # the draws keyed_op would number j = 0, 1, ...
            if draw is None:
                values.append(None)
                continue
            dist, dtype, shape = draw
            out = torch.empty(shape, dtype=dtype)
            fill_folded(lib, out, dist, key, call, j)
            values.append(out)
            j += 1
        return self.result(values)


def _sampler(dist: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> Optional[list]:
    if dtype not in dist.dtypes:
        return None
    return [(dist, dtype, shape)]


def _first(values: list) -> torch.Tensor:
    return values[0]


def _dist(kind: type, *params: Any) -> Any:
    """``kind.create(*params)``, made once per parameters (distributions are immutable). The cache key
    holds each float's sign, since ``-0.0 == 0.0`` (and so hashes alike) but may round differently."""
    signs = tuple(math.copysign(1.0, p) if isinstance(p, float) else 0.0 for p in params)
    return _dist_cached(kind, params, signs)


@functools.lru_cache(maxsize=256)
def _dist_cached(kind: type, params: tuple, signs: tuple) -> Any:
    return kind.create(*params)


def _shape(size: Any) -> Optional[tuple[int, ...]]:
    try:
        return tuple(int(s) for s in size)
    except TypeError:
        return None


def _randint_draw(low: int, high: int, dtype: torch.dtype, shape: tuple[int, ...]) -> Optional[tuple[list, Callable]]:
    if high - low > 2**32 or high <= low:
        return None  # the table refuses: the general path says why
    draw_dtype = dtype if dtype in INT_DTYPES else torch.int64
    try:
        dist = _dist(Randint, low, high, draw_dtype)
    except (TypeError, ValueError):
        return None
    draws = _sampler(dist, draw_dtype, shape)
    if draws is None:
        return None
    if draw_dtype == dtype:
        return draws, _first
    return draws, lambda values: values[0].to(dtype)


def _tensor_bernoulli(p: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[list, Callable]:
    probabilities = p.detach().cpu()

    def finish(values: list) -> torch.Tensor:
        # the table's x < round(p * 2**32) (int64 words against binary64: both exact)
        return torch.lt(values[0], probabilities.double().mul_(2.0**32).round_()).to(dtype)

    return [(Bits(), torch.int64, shape)], finish


#: Up to this ``n``, randperm's positions are sorted in Python (a handful of torch ops cost more).
_SMALL_RANDPERM = 16


def _randperm(n: int, dtype: torch.dtype) -> tuple[list, Callable]:
    def permutation(values: list) -> torch.Tensor:
        # the positions ordered by (hi, lo), ties by position: a stable sort by lo, then a stable one by hi
        hi, lo = values
        if n <= _SMALL_RANDPERM:
            his, los = hi.tolist(), lo.tolist()
            order = torch.tensor(sorted(range(n), key=lambda i: (his[i], los[i])), dtype=torch.int64)
            return order.to(dtype)
        order = torch.argsort(lo, stable=True)
        return order[torch.argsort(hi[order], stable=True)].to(dtype)

    return [(Bits(), torch.int64, (n,)), (_dist(Randint, 0, 2**32, torch.int64), torch.int64, (n,))], permutation


def _target(a: dict) -> Optional[torch.Tensor]:
    """An op's ``self`` where it is a strided tensor (the in-place target, or the ``*_like`` template)."""
    self = a.get("self")
    return self if isinstance(self, torch.Tensor) and self.layout == torch.strided else None


def _sampled(kind: type, params: tuple, dtype: torch.dtype, shape: tuple[int, ...]) -> Optional[list]:
    """The one draw of ``kind.create(*params)``, or None where the sampler refuses (the general path says why)."""
    try:
        return _sampler(_dist(kind, *params), dtype, shape)
    except (TypeError, ValueError):
        return None


def _recipe(made: Optional[tuple], shape: tuple[int, ...], write: Optional[torch.Tensor], device: Any) -> Optional[Recipe]:
    if made is None or made[0] is None:
        return None
    return Recipe(shape, made[0], made[1], write, device)


def _drawn_first(draws: Optional[list]) -> Optional[tuple[list, Callable]]:
    return None if draws is None else (draws, _first)


def _plan_uniform_(a: dict, overload: str, randperm: bool) -> Optional[Recipe]:
    self = _target(a)
    if self is None:
        return None
    shape, dtype = tuple(self.shape), self.dtype
    low, high = float(a.get("from", 0.0)), float(a.get("to", 1.0))
    if dtype not in FLOAT_DTYPES:
        return None
    if low == high:
        return Recipe(shape, [None], lambda values: torch.full(shape, low, dtype=dtype), self, None)
    return _recipe(_drawn_first(_sampled(Uniform, (low, high), dtype, shape)), shape, self, None)


def _plan_normal_(a: dict, overload: str, randperm: bool) -> Optional[Recipe]:
    self = _target(a)
    if self is None:
        return None
    shape, dtype = tuple(self.shape), self.dtype
    mean, std = a.get("mean", 0.0), a.get("std", 1.0)
    if dtype not in FLOAT_DTYPES or isinstance(mean, torch.Tensor) or isinstance(std, torch.Tensor):
        return None
    try:
        params = (float(mean), float(std))
    except (TypeError, ValueError):
        return None
    return _recipe(_drawn_first(_sampled(Normal, params, dtype, shape)), shape, self, None)


def _plan_random_(a: dict, overload: str, randperm: bool) -> Optional[Recipe]:
    self = _target(a)
    if self is None:
        return None
    shape, dtype = tuple(self.shape), self.dtype
    low, high = a.get("from"), a.get("to")
    if high is None:
        if dtype == torch.bool:
            high = 2
        elif dtype.is_floating_point:
            high = 2 ** (1 - int(round(math.log2(torch.finfo(dtype).eps)))) + 1
        else:
            high = torch.iinfo(dtype).max + 1
    return _recipe(_randint_draw(0 if low is None else int(low), int(high), dtype, shape), shape, self, None)


def _plan_bernoulli_(a: dict, overload: str, randperm: bool) -> Optional[Recipe]:
    self = _target(a)
    if self is None:
        return None
    shape, dtype = tuple(self.shape), self.dtype
    p = a.get("p", 0.5)
    if isinstance(p, torch.Tensor):
        return _recipe(_tensor_bernoulli(p, dtype, shape), shape, self, None)
    try:
        params = (float(p),)
    except (TypeError, ValueError):
        return None
    return _recipe(_drawn_first(_sampled(Bernoulli, params, dtype, shape)), shape, self, None)


def _plan_rand(a: dict, overload: str, randperm: bool, kind: type = Uniform) -> Optional[Recipe]:
    shape = _shape(a.get("size"))
    if shape is None:
        return None
    dtype = a.get("dtype") or torch.get_default_dtype()
    if dtype not in FLOAT_DTYPES:
        return None
    return _recipe(_drawn_first(_sampled(kind, (0.0, 1.0), dtype, shape)), shape, None, a.get("device"))


def _plan_randn(a: dict, overload: str, randperm: bool) -> Optional[Recipe]:
    return _plan_rand(a, overload, randperm, Normal)


def _plan_rand_like(a: dict, overload: str, randperm: bool, kind: type = Uniform) -> Optional[Recipe]:
    self = _target(a)
    if self is None:
        return None
    shape, dtype = tuple(self.shape), a.get("dtype") or self.dtype
    device = a.get("device") or self.device
    if dtype not in FLOAT_DTYPES:
        return None
    return _recipe(_drawn_first(_sampled(kind, (0.0, 1.0), dtype, shape)), shape, None, device)


def _plan_randn_like(a: dict, overload: str, randperm: bool) -> Optional[Recipe]:
    return _plan_rand_like(a, overload, randperm, Normal)


def _plan_randint_like(a: dict, overload: str, randperm: bool) -> Optional[Recipe]:
    self = _target(a)
    if self is None:
        return None
    shape, dtype = tuple(self.shape), a.get("dtype") or self.dtype
    device = a.get("device") or self.device
    high = a.get("high")
    if isinstance(high, torch.Tensor) or high is None:
        return None
    return _recipe(_randint_draw(int(a.get("low") or 0), int(high), dtype, shape), shape, None, device)


def _plan_randint(a: dict, overload: str, randperm: bool) -> Optional[Recipe]:
    shape = _shape(a.get("size"))
    if shape is None:
        return None
    dtype = a.get("dtype") or torch.int64
    high = a.get("high")
    if isinstance(high, torch.Tensor) or high is None:
        return None
    return _recipe(_randint_draw(int(a.get("low") or 0), int(high), dtype, shape), shape, None, a.get("device"))


def _plan_bernoulli(a: dict, overload: str, randperm: bool) -> Optional[Recipe]:
    self = _target(a)
    if self is None:
        return None
    shape, dtype, device = tuple(self.shape), self.dtype, self.device
    if overload == "p":
        try:
            params = (float(a.get("p")),)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
        return _recipe(_drawn_first(_sampled(Bernoulli, params, dtype, shape)), shape, None, device)
    if overload == "default":
        return _recipe(_tensor_bernoulli(self, dtype, shape), shape, None, device)
    return None


def _plan_randperm(a: dict, overload: str, randperm: bool) -> Optional[Recipe]:
    if not randperm:
        return None
    n = int(a["n"])
    draws, finish = _randperm(n, a.get("dtype") or torch.int64)
    return Recipe((n,), draws, finish, None, a.get("device"))


#: The planner of each recognized aten op (by name without ``aten::``).
_PLANNERS_BY_NAME: dict[str, Callable[[dict, str, bool], Optional[Recipe]]] = {
    "uniform_": _plan_uniform_, "normal_": _plan_normal_, "random_": _plan_random_, "bernoulli_": _plan_bernoulli_,
    "rand": _plan_rand, "randn": _plan_randn, "rand_like": _plan_rand_like, "randn_like": _plan_randn_like,
    "randint_like": _plan_randint_like, "randint": _plan_randint, "bernoulli": _plan_bernoulli,
    "randperm": _plan_randperm,
}

#: Per op overload: ``(planner, its positional argument names, overload name)``, or None (general path).
_OPS: dict[Any, Optional[tuple]] = {}


def _op_entry(func: Any) -> Optional[tuple]:
    name, overload = func._schema.name, func._overloadname
    if not name.startswith("aten::") or overload.endswith("out") or overload == "names":
        return None
    planner = _PLANNERS_BY_NAME.get(name[len("aten::"):])
    if planner is None:
        return None
    return planner, tuple(arg.name for arg in func._schema.arguments if not arg.kwarg_only), overload


def plan(func: Any, args: tuple, kwargs: dict, *, randperm: bool = True) -> Optional[Recipe]:
    """The :class:`Recipe` of ``func(*args, **kwargs)``, or None where the general path must run.

    Arguments are bound by the op's schema (positional names, read once per op overload), then
    the op's planner applies the rules of :mod:`keyinit._engine.random_ops`'s table to them."""
    try:
        entry = _OPS[func]
    except KeyError:
        entry = _OPS[func] = _op_entry(func)
    if entry is None:
        return None
    planner, names, overload = entry
    a = dict(zip(names, args))
    for name, value in kwargs.items():
        a.setdefault(name, value)
    return planner(a, overload, randperm)
