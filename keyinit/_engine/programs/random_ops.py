r"""Keyed equivalents of torch's random ops, for init code captured by :mod:`keyinit._engine.capture.capture`.

Every aten op torch tags ``nondeterministic_seeded`` (plus ``random_``) that init
code calls on a captured tensor becomes program nodes whose randomness is a
:mod:`keyinit.random` draw, keyed later by where it lands (never the global RNG,
never a ``generator=``). The distribution is the op's; the bits are keyinit's:

==========================  =============================================================
op                          keyed value (``u``: a 32-bit stream word ``x`` as
                            :math:`(x + 1/2)\,2^{-32}` in binary64; ``z``: keyinit normal)
==========================  =============================================================
``uniform_(a, b)``, rand    ``keyinit.random.uniform(low=a, high=b)`` (``a == b``: the constant ``a``)
``normal_(m, s)``, randn    ``keyinit.random.normal(mean=m, std=s)``; tensor ``m``/``s``: ``m + s z`` in binary64
``randint``, ``random_``    ``keyinit.random.randint`` (ranges up to :math:`2^{32}`)
``bernoulli(p)``            ``keyinit.random.bernoulli(p)``; tensor ``p``: ``x < round(p 2^32)``
``exponential_(l)``         :math:`-\ln(u) / l`
``geometric_(p)``           :math:`\lceil \ln(u) / \ln(1 - p) \rceil`
``log_normal_(m, s)``       :math:`\exp(m + s z)`
``cauchy_(m, s)``           :math:`m + s \tan(\pi (u - 1/2))`
``randperm(n)``             stable argsort of two words per element (whole)
``multinomial``             inverse CDF (with replacement) or the exponential race (without), whole
``native_dropout``          keep with ``keyinit.random.bernoulli(1 - p)``
``rrelu_with_noise``        slope ``keyinit.random.uniform(lower, upper)`` on negative inputs
==========================  =============================================================

Transforms are computed in binary64 and rounded once to the output dtype. Ops
with no exact inversion here (``poisson``, ``binomial``, gamma/Dirichlet samplers,
fused attention and RNN kernels with dropout) become *unkeyable* draws: an
:class:`keyinit.UnkeyedRandomnessError` if any tensor that needs them is initialized.

The random-op table: everything keyinit knows of a random op is its one :class:`RandomOp` entry in
:data:`RANDOM_OPS` (by aten name, ``aten::uniform_``), registered below with :func:`register_random_op`,
which refuses a name registered twice: its keyed equivalent above (``keyed``: what captured init code,
``keyinit.data`` and ``keyinit.nn.keyed`` draw), its fast CPU recipe if it has one (``fast``,
:mod:`keyinit._engine.programs.fast_recipes`: ``keyinit.data``'s path without a program, the same bits),
the batch of its output in a keyed forward (``batch``) and whether torch's kernel advances the generator
even where it draws nothing (``advances_at_p0``: keyinit answers it). :func:`random_op` gives an op with no
entry (``poisson``, fused attention kernels, ...) the unkeyable default.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import attrs
import torch

from keyinit import random as keyed
from keyinit.distributions import FLOAT_DTYPES, INT_DTYPES
from keyinit.keys import Key
from keyinit._engine.programs import fast_recipes as fast
from keyinit._engine.programs.program import Const, Node, Pointwise, Random, Whole

__all__ = ["is_random", "keyed_effects", "Effects", "bind_arguments", "RandomOp", "RANDOM_OPS", "register_random_op",
           "random_op", "INPUT", "INPUTS"]

_RANDOM_ALSO = {"aten::random_", "aten::random"}


_IS_RANDOM: dict[Any, bool] = {}


def is_random(func: Any) -> bool:
    """True for every aten op that draws from a generator (cached per op: a dispatch mode asks for every op)."""
    try:
        return _IS_RANDOM[func]
    except (KeyError, TypeError):
        pass
    tags = getattr(func, "tags", ())
    answer = torch.Tag.nondeterministic_seeded in tags or func._schema.name in _RANDOM_ALSO
    try:
        _IS_RANDOM[func] = answer
    except TypeError:  # pragma: no cover - an unhashable op
        pass
    return answer


@attrs.frozen
class _Sampler:
    """``fill(key, target)`` of a :mod:`keyinit.random` sampler (values depend only on the flat index)."""

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    def __call__(self, key: Key, target: Any) -> None:
        getattr(keyed, self.name)(key, target.global_shape, **dict(self.params), region=target.region, out=target.out)


@attrs.frozen
class Effects:
    """What a random op does: the values of its returns (None: the return is a mutated argument)
    and the values written into its mutated tensor arguments (by argument name)."""

    returns: tuple[Optional[Node], ...]
    writes: tuple[tuple[str, Node], ...]


def bind_arguments(func: Any, args: tuple, kwargs: dict, *, defaults: bool = False) -> dict[str, Any]:
    """``{argument name: value}`` of an aten call, by its schema (with ``defaults``: every argument,
    missing ones at their default or None)."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif defaults:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


class _Builder:
    """One call of a random op as its keyed equivalent sees it: the output's shape and dtype, the op's
    outputs run on meta tensors, how arguments become nodes, and which argument an aliasing op writes."""

    def __init__(self, func: Any, shape: tuple[int, ...], dtype: torch.dtype, site: str,
                 read: Callable[[Any], Node], caller: str = "init code", outputs: Optional[list] = None) -> None:
        self.op = func._schema.name.replace("aten::", "") + (f".{func._overloadname}" if func._overloadname != "default" else "")
        self.shape, self.dtype, self.site, self.read, self.caller = shape, dtype, site, read, caller
        self.outputs = outputs or []
        self.name = func._schema.name.replace("aten::", "")
        self.inplace = self.name.endswith("_")
        self.returns_alias = self.inplace or any(arg.kwarg_only and arg.alias_info is not None and
                                                 arg.alias_info.is_write for arg in func._schema.arguments)
        self.out_name = "self" if self.inplace else next((arg.name for arg in func._schema.arguments if arg.kwarg_only
                                                          and arg.alias_info is not None and arg.alias_info.is_write), None)

    def single(self, value: Node) -> Effects:
        """The effects of an op with one result: returned, or written into the argument it aliases."""
        if self.returns_alias:
            return Effects((None,), ((self.out_name, value),))
        return Effects((value,), ())

    def unkeyable(self, why: str, shape: Optional[tuple[int, ...]] = None, dtype: Optional[torch.dtype] = None) -> Random:
        return Random(shape or self.shape, dtype or self.dtype, self.op, self.site,
                      unkeyable=f"{self.caller} called {self.op}(), which keyinit cannot key: {why}")

    def sample(self, name: str, dtype: Optional[torch.dtype] = None, shape: Optional[tuple[int, ...]] = None,
               **params: Any) -> Random:
        return Random(shape if shape is not None else self.shape, dtype or self.dtype,
                      f"{self.op}({', '.join(f'{k}={v}' for k, v in params.items())})", self.site,
                      _Sampler(name, tuple(params.items())), by_index=True)

    def words(self) -> Random:
        return self.sample("bits", torch.int64)

    def unit(self) -> Random:
        """Stream words for ``u = (x + 1/2) 2**-32`` (open interval (0, 1))."""
        return self.words()

    def pointwise(self, fn: Callable[..., torch.Tensor], *args: Node, name: str) -> Pointwise:
        return Pointwise(self.shape, self.dtype, fn, tuple(args), f"{self.op}:{name}")

    def cast(self, node: Node) -> Node:
        if node.dtype == self.dtype:
            return node
        dtype = self.dtype
        return Pointwise(self.shape, dtype, lambda x: x.to(dtype), (node,), f"{self.op}:cast", exact=True)


def _u(words: torch.Tensor) -> torch.Tensor:
    return (words.double() + 0.5) * 2.0**-32


def _uniform(b: _Builder, low: float, high: float) -> Node:
    if b.dtype not in FLOAT_DTYPES:
        return b.unkeyable(f"it fills a {b.dtype} tensor (keyinit draws float32, float64, bfloat16, float16)")
    low, high = float(low), float(high)
    if low == high:
        return Const(b.shape, b.dtype, low)
    return b.sample("uniform", low=low, high=high)


def _normal(b: _Builder, mean: Any, std: Any) -> Node:
    if b.dtype not in FLOAT_DTYPES:
        return b.unkeyable(f"it fills a {b.dtype} tensor (keyinit draws float32, float64, bfloat16, float16)")
    if not isinstance(mean, torch.Tensor) and not isinstance(std, torch.Tensor):
        return b.sample("normal", mean=float(mean), std=float(std))
    z = b.sample("normal", torch.float32)
    dtype = b.dtype
    m = b.read(mean) if isinstance(mean, torch.Tensor) else Const((), torch.float64, float(mean))
    s = b.read(std) if isinstance(std, torch.Tensor) else Const((), torch.float64, float(std))
    return b.pointwise(lambda z, m, s: (m.double() + s.double() * z.double()).to(dtype), z, m, s, name="mean+std*z")


def _randint(b: _Builder, low: int, high: int) -> Node:
    if high - low > 2**32:
        return b.unkeyable(f"its range [{low}, {high}) is wider than 2**32 (keyinit.random.randint's limit)")
    if high <= low:
        return b.unkeyable(f"its range [{low}, {high}) is empty")
    draw_dtype = b.dtype if b.dtype in INT_DTYPES else torch.int64
    return b.cast(b.sample("randint", draw_dtype, low=int(low), high=int(high)))


def _random_range(b: _Builder, low: Optional[int], high: Optional[int]) -> Node:
    dtype = b.dtype
    if high is None:
        if dtype == torch.bool:
            high = 2
        elif dtype.is_floating_point:  # torch: [0, 2**digits], digits of the significand
            high = 2 ** (1 - int(round(math.log2(torch.finfo(dtype).eps)))) + 1
        else:
            high = torch.iinfo(dtype).max + 1
    return _randint(b, 0 if low is None else int(low), int(high))


def _bernoulli(b: _Builder, p: Any) -> Node:
    if not isinstance(p, torch.Tensor):
        return b.sample("bernoulli", p=float(p))
    words = b.words()
    dtype = b.dtype
    return b.pointwise(lambda x, p: (x < torch.round(p.double() * 2.0**32)).to(dtype), words, b.read(p),
                       name="x<round(p*2**32)")


def _transform(b: _Builder, fn: Callable[[torch.Tensor], torch.Tensor], name: str) -> Node:
    if b.dtype not in FLOAT_DTYPES:
        return b.unkeyable(f"it fills a {b.dtype} tensor")
    dtype = b.dtype
    return b.pointwise(lambda x: fn(_u(x)).to(dtype), b.unit(), name=name)


def _randperm(b: _Builder, n: int) -> Node:
    hi = b.sample("bits", torch.int64, (n,))
    lo = b.sample("randint", torch.int64, (n,), low=0, high=2**32)  # a second, independent word per element
    dtype = b.dtype

    def permutation(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(lo, stable=True)
        return order[torch.argsort(hi[order], stable=True)].to(dtype)

    return Whole((n,), dtype, permutation, (hi, lo), f"{b.op}(n={n})")


def _multinomial(b: _Builder, probs: Any, num_samples: int, replacement: bool) -> Node:
    p = b.read(probs)
    rows = 1 if len(p.shape) == 1 else p.shape[0]
    categories = p.shape[-1]
    shape = b.shape
    width = num_samples if replacement else categories
    # the words of row r are row r's of a (rows, width) tensor; where the output is laid out per sample
    # (keyinit._engine.keyed.keyed_op: (count, *sample_shape), a sample's rows in order), of a tensor laid out as
    # the output with width in place of num_samples: (count, ..., width), each sample's rows its own words
    draws = b.sample("bits", torch.int64, tuple(shape[:-1]) + (width,) if len(shape) >= 2 else (rows, width))

    def sample(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        weights = p.double().reshape(rows, categories)
        u = _u(x).reshape(rows, width)
        if replacement:
            cdf = torch.cumsum(weights, dim=1)
            picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=categories - 1)
        else:  # the first num_samples of an exponential race with rates p
            race = -torch.log(u) / weights
            picks = torch.argsort(race, dim=1, stable=True)[:, :num_samples]
        return picks.reshape(shape).to(torch.int64)

    return Whole(shape, torch.int64, sample, (p, draws), f"{b.op}(num_samples={num_samples}, replacement={replacement})")


# The keyed equivalent of each random op (the branches of docs/spec.md section 15): (call, bound arguments) -> Effects.

def _keyed_uniform(b: _Builder, a: dict) -> Effects:
    return b.single(_uniform(b, a.get("from", 0.0), a.get("to", 1.0)))


def _keyed_normal(b: _Builder, a: dict) -> Effects:
    return b.single(_normal(b, a.get("mean", 0.0), a.get("std", 1.0)))


def _keyed_rand(b: _Builder, a: dict) -> Effects:
    return b.single(_uniform(b, 0.0, 1.0))


def _keyed_randn(b: _Builder, a: dict) -> Effects:
    return b.single(_normal(b, 0.0, 1.0))


def _keyed_randint(b: _Builder, a: dict) -> Effects:
    high = a.get("high")
    if isinstance(high, torch.Tensor):
        return b.single(b.unkeyable("its bound is a tensor"))
    return b.single(_randint(b, int(a.get("low") or 0), int(high)))


def _keyed_random(b: _Builder, a: dict) -> Effects:
    return b.single(_random_range(b, a.get("from"), a.get("to")))


def _keyed_bernoulli(b: _Builder, a: dict) -> Effects:
    p = a.get("p")
    if p is None:
        p = a.get("self")  # bernoulli(self): the probabilities are the input's values
    return b.single(_bernoulli(b, p))


def _keyed_exponential(b: _Builder, a: dict) -> Effects:
    lambd = float(a.get("lambd", 1.0))
    return b.single(_transform(b, lambda u: -torch.log(u) / lambd, f"-log(u)/{lambd}"))


def _keyed_geometric(b: _Builder, a: dict) -> Effects:
    p = float(a["p"])
    return b.single(_transform(b, lambda u: torch.ceil(torch.log(u) / math.log1p(-p)), f"ceil(log(u)/log1p(-{p}))"))


def _keyed_log_normal(b: _Builder, a: dict) -> Effects:
    mean, std = float(a.get("mean", 1.0)), float(a.get("std", 2.0))
    z = b.sample("normal", torch.float32)
    dtype = b.dtype
    return b.single(b.pointwise(lambda z: torch.exp(mean + std * z.double()).to(dtype), z, name="exp(mean+std*z)"))


def _keyed_cauchy(b: _Builder, a: dict) -> Effects:
    median, sigma = float(a.get("median", 0.0)), float(a.get("sigma", 1.0))
    return b.single(_transform(b, lambda u: median + sigma * torch.tan(math.pi * (u - 0.5)), "cauchy"))


def _keyed_randperm(b: _Builder, a: dict) -> Effects:
    return b.single(_randperm(b, int(a["n"])))


def _keyed_multinomial(b: _Builder, a: dict) -> Effects:
    return b.single(_multinomial(b, a["self"], int(a["num_samples"]), bool(a.get("replacement"))))


def _keyed_native_dropout(b: _Builder, a: dict) -> Effects:
    shape, outputs = b.shape, b.outputs
    x = a["input"]
    p = float(a["p"])
    train = a.get("train")
    xs = b.read(x)
    if train is False or p == 0.0:
        out_dtype = b.dtype
        return Effects((Pointwise(shape, out_dtype, lambda v: v.clone(), (xs,), "dropout:identity", exact=True),
                        Const(tuple(outputs[1].shape), torch.bool, True)), ())
    keep = b.sample("bernoulli", torch.bool, p=1.0 - p)
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    out_dtype = b.dtype
    out = Pointwise(shape, out_dtype, lambda v, k: v * k * scale, (xs, keep), "dropout")
    return Effects((out, keep), ())


def _keyed_rrelu_with_noise(b: _Builder, a: dict) -> Effects:
    shape = b.shape
    x = b.read(a["self"])
    lower, upper = float(a.get("lower", 0.125)), float(a.get("upper", 1.0 / 3))
    training = bool(a.get("training"))
    dtype = b.dtype
    if training:
        slope: Node = b.sample("uniform", dtype, low=lower, high=upper) if lower < upper else Const(shape, dtype, lower)
    else:
        slope = Const(shape, dtype, (lower + upper) / 2)
    out = Pointwise(shape, dtype, lambda v, r: torch.where(v >= 0, v, v * r), (x, slope), "rrelu")
    noise = Pointwise(shape, dtype, lambda v, r: torch.where(v >= 0, torch.ones_like(r), r), (x, slope), "rrelu:noise")
    if b.name == "rrelu_with_noise_functional":
        return Effects((out, noise), ())
    if b.inplace or b.returns_alias:  # rrelu_with_noise_ writes self; the .out variant writes out
        return Effects((None,), ((b.out_name, out), ("noise", noise)))
    return Effects((out,), (("noise", noise),))


def _unkeyable(b: _Builder, a: dict) -> Effects:
    """Anything else (poisson, binomial, gamma, Dirichlet, fused attention/RNN dropout kernels)."""
    values = tuple(b.unkeyable("it has no keyed equivalent (no exact inversion from uniform words)",
                               tuple(o.shape), o.dtype) for o in b.outputs)
    if b.returns_alias:
        return Effects((None,) * len(values), ((b.out_name, values[0]),) if values else ())
    return Effects(values, ())


#: ``RandomOp.batch``: the output's batch in a keyed forward is its first tensor input's (in place, ``*_like``)
INPUT = "input"
#: ``RandomOp.batch``: the output's batch is its tensor inputs' broadcast (``bernoulli(p)``, ``normal(mean, std)``)
INPUTS = "inputs"


@attrs.frozen
class RandomOp:
    """Everything keyinit knows of one random aten op (every overload of ``name``).

    ``keyed``: its keyed equivalent, ``(call, bound arguments) -> Effects`` (``docs/spec.md`` section 15;
    None: unkeyable); ``fast``: its fast CPU recipe, a planner of
    :mod:`keyinit._engine.programs.fast_recipes` giving the same bits (None: ``keyinit.data`` takes the
    general path); ``batch``: its output's batch in a keyed forward where it has tensor inputs
    (:data:`INPUT` or :data:`INPUTS`; with none it is laid out by its sizes); ``advances_at_p0``: torch's
    kernel advances the generator even where it draws nothing (``p = 0``, ``train=False``), so keyinit
    answers it there too instead of letting it run.
    """

    name: str
    keyed: Optional[Callable[[_Builder, dict], Effects]]
    fast: Optional[fast.Planner] = None
    batch: str = INPUTS
    advances_at_p0: bool = False


#: The random-op table, by aten name. Add an op with :func:`register_random_op`, below.
RANDOM_OPS: dict[str, RandomOp] = {}


def register_random_op(entry: RandomOp) -> RandomOp:
    """Add ``entry`` to :data:`RANDOM_OPS`; an op registered twice is an error (one entry per op)."""
    if not entry.name.startswith("aten::"):
        raise ValueError(f"a random op's name is its aten name ('aten::uniform_'), got {entry.name!r}")
    if entry.batch not in (INPUT, INPUTS):
        raise ValueError(f"{entry.name}: batch must be {INPUT!r} or {INPUTS!r}, got {entry.batch!r}")
    if entry.name in RANDOM_OPS:
        raise ValueError(f"random op {entry.name} is already in the random-op table: one entry per op")
    RANDOM_OPS[entry.name] = entry
    return entry


_UNLISTED: dict[str, RandomOp] = {}


def random_op(name: str) -> RandomOp:
    """The entry of the random op ``name`` (``aten::uniform_``); an op with none is unkeyable, its output's
    batch its input's if it writes in place, else its inputs' broadcast."""
    entry = RANDOM_OPS.get(name)
    if entry is None:
        entry = _UNLISTED.get(name)
        if entry is None:
            entry = _UNLISTED[name] = RandomOp(name, None, batch=INPUT if name.endswith("_") else INPUTS)
    return entry


for _entry in (
    RandomOp("aten::uniform_", _keyed_uniform, fast._plan_uniform_, INPUT),
    RandomOp("aten::uniform", _keyed_uniform),
    RandomOp("aten::normal_", _keyed_normal, fast._plan_normal_, INPUT),
    RandomOp("aten::normal", _keyed_normal),
    RandomOp("aten::normal_functional", _keyed_normal),
    RandomOp("aten::rand", _keyed_rand, fast._plan_rand),
    RandomOp("aten::rand_like", _keyed_rand, fast._plan_rand_like, INPUT),
    RandomOp("aten::randn", _keyed_randn, fast._plan_randn),
    RandomOp("aten::randn_like", _keyed_randn, fast._plan_randn_like, INPUT),
    RandomOp("aten::randint", _keyed_randint, fast._plan_randint),
    RandomOp("aten::randint_like", _keyed_randint, fast._plan_randint_like, INPUT),
    RandomOp("aten::random_", _keyed_random, fast._plan_random_, INPUT),
    RandomOp("aten::random", _keyed_random),
    RandomOp("aten::bernoulli_", _keyed_bernoulli, fast._plan_bernoulli_, INPUT, advances_at_p0=True),
    RandomOp("aten::bernoulli", _keyed_bernoulli, fast._plan_bernoulli, advances_at_p0=True),
    RandomOp("aten::exponential_", _keyed_exponential, batch=INPUT),
    RandomOp("aten::exponential", _keyed_exponential),
    RandomOp("aten::geometric_", _keyed_geometric, batch=INPUT),
    RandomOp("aten::geometric", _keyed_geometric),
    RandomOp("aten::log_normal_", _keyed_log_normal, batch=INPUT),
    RandomOp("aten::log_normal", _keyed_log_normal),
    RandomOp("aten::cauchy_", _keyed_cauchy, batch=INPUT),
    RandomOp("aten::cauchy", _keyed_cauchy),
    RandomOp("aten::randperm", _keyed_randperm, fast._plan_randperm),
    RandomOp("aten::multinomial", _keyed_multinomial),
    RandomOp("aten::native_dropout", _keyed_native_dropout, batch=INPUT, advances_at_p0=True),
    RandomOp("aten::rrelu_with_noise_", _keyed_rrelu_with_noise, batch=INPUT),
    RandomOp("aten::rrelu_with_noise", _keyed_rrelu_with_noise),
    RandomOp("aten::rrelu_with_noise_functional", _keyed_rrelu_with_noise),
):
    register_random_op(_entry)
del _entry


def keyed_effects(func: Any, args: tuple, kwargs: dict, outputs: list[torch.Tensor], site: str,
                  read: Callable[[Any], Node], caller: str = "init code") -> Effects:
    """The keyed version of the random op ``func(*args, **kwargs)``: its table entry's ``keyed``.

    ``outputs`` are the op's returns run on meta tensors (their shapes and dtypes);
    ``read(tensor)`` turns an argument into a node; ``caller`` names the code that
    called the op in the error of an unkeyable draw.
    """
    a = bind_arguments(func, args, kwargs, defaults=True)
    first = outputs[0] if outputs else None
    shape = tuple(first.shape) if first is not None else ()
    dtype = first.dtype if first is not None else torch.float32
    b = _Builder(func, shape, dtype, site, read, caller, outputs)
    entry = RANDOM_OPS.get(func._schema.name)
    return (entry.keyed if entry is not None and entry.keyed is not None else _unkeyable)(b, a)
