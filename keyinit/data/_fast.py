"""The common random ops of data pipelines, keyed without building a program.

:func:`plan` recognizes ``uniform_``, ``normal_``, ``rand``, ``randn``, ``rand_like``, ``randn_like``,
``randint``, ``random_``, ``bernoulli``/``bernoulli_`` (scalar or tensor ``p``) and ``randperm`` with
arguments the table of :mod:`keyinit._engine.programs.random_ops` maps to plain samplers, and returns a
:class:`Recipe`: the draws the keyed equivalent makes (sampler, dtype, shape, in the order
:func:`keyinit._engine.keyed.keyed_op.keyed_op` numbers them) and how the result is made from them. The
values are those of the table, bit for bit: the same samplers, the same arithmetic; only the
meta run, the program nodes and the evaluator are skipped. Anything else (other ops, other
overloads, ``out=``, arguments the table refuses) is None, and callers take the general path.
:meth:`Recipe.drawn` makes a recognized op's value with the CPU fill kernel (:mod:`keyinit.data._fill`),
writing an in-place op's contiguous CPU target directly.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import torch
from torch.autograd.graph import increment_version

from keyinit.data._fill import fill_folded
from keyinit.distributions import FLOAT_DTYPES, INT_DTYPES, Bernoulli, Bits, Normal, Randint, Uniform
from keyinit.keys import Key

__all__ = ["plan", "Recipe"]


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
    the op's planner applies the rules of :mod:`keyinit._engine.programs.random_ops`'s table to them."""
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
