"""The common random ops of data pipelines, keyed without building a program.

:func:`plan` runs the fast CPU recipe of an op's entry in the random-op table
(:mod:`keyinit._engine.programs.random_ops`; the recipes are
:mod:`keyinit._engine.programs.fast_recipes`: ``uniform_``, ``normal_``, ``rand``, ``randn``,
``rand_like``, ``randn_like``, ``randint``, ``random_``, ``bernoulli``/``bernoulli_`` (scalar or tensor
``p``) and ``randperm`` with arguments the table maps to plain samplers) and returns a :class:`Recipe`:
the draws the keyed equivalent makes (sampler, dtype, shape, in the order
:func:`keyinit._engine.keyed.keyed_op.keyed_op` numbers them) and how the result is made from them. The
values are those of the table, bit for bit. Anything else (other ops, other overloads, ``out=``,
arguments the table refuses) is None, and callers take the general path.
:meth:`Recipe.drawn` makes a recognized op's value with the CPU fill kernel (:mod:`keyinit.data._fill`),
writing an in-place op's contiguous CPU target directly.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.autograd.graph import increment_version

from keyinit._engine.programs.fast_recipes import first_value
from keyinit._engine.programs.random_ops import RANDOM_OPS
from keyinit.data._fill import fill_folded
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
        if write is not None and self.finish is first_value and type(write) is torch.Tensor and \
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


#: Per op overload: ``(planner, its positional argument names, overload name)``, or None (general path).
_OPS: dict[Any, Optional[tuple]] = {}


def _op_entry(func: Any) -> Optional[tuple]:
    name, overload = func._schema.name, func._overloadname
    if not name.startswith("aten::") or overload.endswith("out") or overload == "names":
        return None
    entry = RANDOM_OPS.get(name)
    planner = entry.fast if entry is not None else None
    if planner is None:
        return None
    return planner, tuple(arg.name for arg in func._schema.arguments if not arg.kwarg_only), overload


def plan(func: Any, args: tuple, kwargs: dict, *, randperm: bool = True) -> Optional[Recipe]:
    """The :class:`Recipe` of ``func(*args, **kwargs)``, or None where the general path must run.

    Arguments are bound by the op's schema (positional names, read once per op overload), then
    the op's planner (its entry's ``fast`` in :mod:`keyinit._engine.programs.random_ops`) applies the rules of
    its keyed equivalent to them."""
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
    made = planner(a, overload, randperm)
    return None if made is None else Recipe(*made)
