"""Guards for user code keyinit runs: module rules must not write the model while planning, and
initializers of the user's own must not draw from torch's RNG.

:func:`no_writes` runs a block under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
that refuses, BEFORE it runs, any aten op that mutates a tensor sharing storage with a
protected tensor (``weight.zero_()``, ``nn.init.normal_(weight)``, ``weight.data.copy_(x)``),
and afterwards puts back any parameter or buffer the block re-assigned. Either is a
:class:`keyinit.errors.PlanError`: planning must leave the model exactly as it was.

:func:`run_fill` runs an initializer ``fill(key, target)``; one that is not keyinit's own runs
under a mode that refuses, before it runs, every aten op that draws from a torch generator
(``torch.randn`` inside a rule ``fn(key, target)``): its values would not be keyed, would differ
between layouts and would advance the global RNG. The refusal is an
:class:`keyinit.errors.UnkeyedRandomnessError` naming the tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from keyinit._engine.programs.refusal import RefuseDraws
from keyinit.errors import PlanError, UnkeyedRandomnessError

__all__ = ["ModelState", "model_kept", "no_writes", "run_fill", "storages_of"]


def _storage(tensor: torch.Tensor) -> int:
    """The data pointer of ``tensor``'s storage (its local shard for a DTensor); 0 for meta."""
    local = getattr(tensor, "_local_tensor", tensor)
    if local.device.type == "meta":
        return 0
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


class _RefuseWrites(TorchDispatchMode):
    def __init__(self, storages: dict[int, str], what: str) -> None:
        super().__init__()
        self.storages = storages
        self.what = what

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for index, argument in enumerate(schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                value = args[index] if index < len(args) else kwargs.get(argument.name)
                for tensor in tree_flatten(value)[0]:
                    if isinstance(tensor, torch.Tensor) and _storage(tensor) in self.storages:
                        name = self.storages[_storage(tensor)]
                        raise PlanError(f"{self.what} writes {name} ({func.__name__}) while keyinit plans: a module "
                                        f"rule must only return initializers; nothing was written", (name,))
        return func(*args, **kwargs)


def _data_state(tensor: torch.Tensor) -> tuple:
    """What ``tensor.data = x`` (``module.double()``, ``to_empty``) or ``requires_grad_`` changes."""
    try:
        strides = tuple(tensor.stride()) if tensor.layout == torch.strided else None
        offset = tensor.storage_offset() if tensor.layout == torch.strided else None
    except (RuntimeError, NotImplementedError):
        strides = offset = None
    return (type(tensor), tensor.dtype, tensor.device, tuple(tensor.shape), strides, offset, _storage(tensor),
            tensor.requires_grad)


class ModelState:
    """The structure of ``modules`` (their parameter, buffer and child tables) and the data and
    ``requires_grad`` of the ``named`` tensors, kept without copying a value, to check and put back.
    :meth:`restore` also puts back each module's other attributes (train/eval mode, hook tables,
    plain attributes), so code that failed leaves the modules as they were."""

    _TABLES = ("_parameters", "_buffers", "_modules")

    def __init__(self, modules: Iterable[torch.nn.Module], named: Iterable[tuple[str, torch.Tensor]]) -> None:
        # a torch.jit.script module's tables are C++ wrappers, which Python code cannot re-assign: not kept
        modules = [m for m in modules if not isinstance(m, torch.jit.ScriptModule)]
        self.tables = [(m, table, dict(getattr(m, table))) for m in modules for table in self._TABLES]
        self.attributes = [(m, dict(vars(m)), {k: _contents(v) for k, v in vars(m).items()
                                               if isinstance(v, (dict, set))}) for m in modules]
        self.tensors = [(name, t, t.data, _data_state(t)) for name, t in named]

    def changes(self) -> tuple[list[str], list[str]]:
        """(re-assigned or added or removed names, names of tensors whose data or requires_grad changed)."""
        assigned = sorted({name for m, table, before in self.tables for name in set(before) | set(getattr(m, table))
                           if getattr(m, table).get(name) is not before.get(name)})
        swapped = [name for name, t, _data, state in self.tensors if _data_state(t) != state]
        return assigned, swapped

    def restore(self) -> None:
        for m, attributes, contents in self.attributes:
            current = vars(m)
            for name in [name for name in current if name not in attributes]:
                del current[name]
            current.update(attributes)
            for name, items in contents.items():  # hook tables, the non-persistent buffer set
                if not _same_contents(attributes[name], items):
                    attributes[name].clear()
                    attributes[name].update(items)
        for m, table, before in self.tables:
            current = getattr(m, table)
            if len(current) != len(before) or any(current.get(k, current) is not v for k, v in before.items()):
                current.clear()
                current.update(before)
        for _name, t, data, state in self.tensors:
            if _data_state(t) != state:
                with torch.no_grad():
                    if _data_state(t)[:-1] != state[:-1]:
                        t.data = data
                    t.requires_grad_(state[-1])


def _contents(container: "dict | set") -> "dict | set":
    """A shallow copy of a module's dict (a hook table) or set (of buffer names)."""
    return dict(container) if isinstance(container, dict) else set(container)


def _same_contents(now: "dict | set", before: "dict | set") -> bool:
    """A dict holds the same objects under the same keys (a hook is not compared by value); a set the same names."""
    if isinstance(before, dict):
        return now.keys() == before.keys() and all(now[k] is v for k, v in before.items())
    return now == before


def _problem(assigned: list[str], swapped: list[str]) -> str:
    parts = []
    if assigned:
        parts.append(f"re-assigned {assigned}")
    if swapped:
        parts.append(f"changed the data, dtype, device or requires_grad of {swapped}")
    return " and ".join(parts)


def storages_of(named: Iterable[tuple[str, torch.Tensor]]) -> dict[int, str]:
    """``{storage pointer: name}`` of the ``named`` tensors (the first name of a shared storage)."""
    storages: dict[int, str] = {}
    for name, tensor in named:
        pointer = _storage(tensor)
        if pointer:
            storages.setdefault(pointer, name)
    return storages


@contextlib.contextmanager
def no_writes(modules: Iterable[torch.nn.Module], named: Iterable[tuple[str, torch.Tensor]], what: str,
              storages: "dict[int, str] | None" = None) -> Iterator[None]:
    """Run the block refusing writes to the ``named`` tensors (or to every storage in ``storages``),
    and any re-assignment in ``modules`` or change of a named tensor's data; what the block
    changed is put back, also when it raises."""
    named = list(named)
    if storages is None:
        storages = storages_of(named)
    state = ModelState(modules, named)
    try:
        with _RefuseWrites(storages, what) if storages else contextlib.nullcontext():
            yield
    except BaseException:
        state.restore()
        raise
    problem = _problem(*state.changes())
    if problem:
        state.restore()
        raise PlanError(f"{what} {problem} while keyinit planned (put back); a module rule must only return "
                        f"initializers")


@contextlib.contextmanager
def model_kept(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], what: str) -> Iterator[None]:
    """The whole model as it was after the block (module rules reaching past their own module):
    put back, and a :class:`PlanError` naming what changed; put back too when the block raises.
    Writes are not refused here (``storages={}``): only what changed afterwards counts."""
    with no_writes(model.modules(), named, what, storages={}):
        yield


def _refuse_draw(what: str, fill: Any) -> Callable[[Any], None]:
    """How :func:`run_fill` refuses a draw of ``fill``, the initializer of ``what``."""

    def refuse(func: Any) -> None:
        raise UnkeyedRandomnessError(
            f"{what}: the initializer {fill!r} called {func}, which draws from torch's random number "
            "generator: its values would not be keyed (they would depend on the RNG state and on the layout). "
            "Draw with keyinit.random.* and the key the initializer is given (key, target.global_shape, "
            "region=target.region, out=target.out)")

    return refuse


def run_fill(fill: Any, key: Any, target: Any) -> None:
    """``fill(key, target)``; an initializer that is not keyinit's own may not draw from torch's RNG."""
    if type(fill).__module__.startswith("keyinit."):
        fill(key, target)
        return
    with RefuseDraws(_refuse_draw(target.fqn, fill)):
        fill(key, target)
