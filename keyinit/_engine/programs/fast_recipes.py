"""Fast CPU recipes of the common random ops: an op's keyed values as plain sampler draws and one finishing step.

A recipe is what :mod:`keyinit.data`'s fast path runs instead of building a program: the draws the op's
keyed equivalent (:mod:`keyinit._engine.programs.random_ops`, ``docs/spec.md`` section 15) makes
(sampler, dtype, shape, in the order :func:`keyinit._engine.keyed.keyed_op.keyed_op` numbers them) and
how the op's value is made from them, bit for bit the keyed equivalent's: the same samplers, the same
arithmetic; only the meta run, the program nodes and the evaluator are skipped. Each planner here is the
``fast`` of its op's entry in the random-op table; it returns None for arguments the keyed equivalent
refuses or maps to anything but plain samplers (callers then take the general path).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import torch

from keyinit.distributions import FLOAT_DTYPES, INT_DTYPES, Bernoulli, Bits, Normal, Randint, Uniform

#: A recipe: ``(shape, draws, finish, write, device)``. ``draws``: ``(distribution, dtype, shape)`` per keyed
#: draw ``j`` (None: a constant, no draw); ``finish(values)``: the op's value (CPU) from the drawn tensors;
#: ``write``: the tensor an in-place op writes (None: the op returns a new tensor on ``device``).
Fast = tuple

#: A planner: ``(bound arguments, overload name, randperm allowed) -> recipe or None``.
Planner = Callable[[dict, str, bool], Optional[Fast]]


def _sampler(dist: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> Optional[list]:
    if dtype not in dist.dtypes:
        return None
    return [(dist, dtype, shape)]


def first_value(values: list) -> torch.Tensor:
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
        return draws, first_value
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


def _recipe(made: Optional[tuple], shape: tuple[int, ...], write: Optional[torch.Tensor], device: Any) -> Optional[Fast]:
    if made is None or made[0] is None:
        return None
    return shape, made[0], made[1], write, device


def _drawn_first(draws: Optional[list]) -> Optional[tuple[list, Callable]]:
    return None if draws is None else (draws, first_value)


def _plan_uniform_(a: dict, overload: str, randperm: bool) -> Optional[Fast]:
    self = _target(a)
    if self is None:
        return None
    shape, dtype = tuple(self.shape), self.dtype
    low, high = float(a.get("from", 0.0)), float(a.get("to", 1.0))
    if dtype not in FLOAT_DTYPES:
        return None
    if low == high:
        return shape, [None], lambda values: torch.full(shape, low, dtype=dtype), self, None
    return _recipe(_drawn_first(_sampled(Uniform, (low, high), dtype, shape)), shape, self, None)


def _plan_normal_(a: dict, overload: str, randperm: bool) -> Optional[Fast]:
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


def _plan_random_(a: dict, overload: str, randperm: bool) -> Optional[Fast]:
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


def _plan_bernoulli_(a: dict, overload: str, randperm: bool) -> Optional[Fast]:
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


def _plan_rand(a: dict, overload: str, randperm: bool, kind: type = Uniform) -> Optional[Fast]:
    shape = _shape(a.get("size"))
    if shape is None:
        return None
    dtype = a.get("dtype") or torch.get_default_dtype()
    if dtype not in FLOAT_DTYPES:
        return None
    return _recipe(_drawn_first(_sampled(kind, (0.0, 1.0), dtype, shape)), shape, None, a.get("device"))


def _plan_randn(a: dict, overload: str, randperm: bool) -> Optional[Fast]:
    return _plan_rand(a, overload, randperm, Normal)


def _plan_rand_like(a: dict, overload: str, randperm: bool, kind: type = Uniform) -> Optional[Fast]:
    self = _target(a)
    if self is None:
        return None
    shape, dtype = tuple(self.shape), a.get("dtype") or self.dtype
    device = a.get("device") or self.device
    if dtype not in FLOAT_DTYPES:
        return None
    return _recipe(_drawn_first(_sampled(kind, (0.0, 1.0), dtype, shape)), shape, None, device)


def _plan_randn_like(a: dict, overload: str, randperm: bool) -> Optional[Fast]:
    return _plan_rand_like(a, overload, randperm, Normal)


def _plan_randint_like(a: dict, overload: str, randperm: bool) -> Optional[Fast]:
    self = _target(a)
    if self is None:
        return None
    shape, dtype = tuple(self.shape), a.get("dtype") or self.dtype
    device = a.get("device") or self.device
    high = a.get("high")
    if isinstance(high, torch.Tensor) or high is None:
        return None
    return _recipe(_randint_draw(int(a.get("low") or 0), int(high), dtype, shape), shape, None, device)


def _plan_randint(a: dict, overload: str, randperm: bool) -> Optional[Fast]:
    shape = _shape(a.get("size"))
    if shape is None:
        return None
    dtype = a.get("dtype") or torch.int64
    high = a.get("high")
    if isinstance(high, torch.Tensor) or high is None:
        return None
    return _recipe(_randint_draw(int(a.get("low") or 0), int(high), dtype, shape), shape, None, a.get("device"))


def _plan_bernoulli(a: dict, overload: str, randperm: bool) -> Optional[Fast]:
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


def _plan_randperm(a: dict, overload: str, randperm: bool) -> Optional[Fast]:
    if not randperm:
        return None
    n = int(a["n"])
    draws, finish = _randperm(n, a.get("dtype") or torch.int64)
    return (n,), draws, finish, None, a.get("device")
