"""A guard for user code that must not write the model (module rules while planning).

:func:`no_writes` runs a block under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
that refuses, BEFORE it runs, any aten op that mutates a tensor sharing storage with a
protected tensor (``weight.zero_()``, ``nn.init.normal_(weight)``, ``weight.data.copy_(x)``),
and afterwards puts back any parameter or buffer the block re-assigned. Either is a
:class:`keyinit.errors.PlanError`: planning must leave the model exactly as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from keyinit.errors import PlanError

__all__ = ["no_writes"]


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


@contextlib.contextmanager
def no_writes(modules: Iterable[torch.nn.Module], named: Iterable[tuple[str, torch.Tensor]], what: str) -> Iterator[None]:
    """Run the block refusing writes to the ``named`` tensors and re-assignments in ``modules``."""
    storages = {}
    for name, tensor in named:
        pointer = _storage(tensor)
        if pointer:
            storages.setdefault(pointer, name)
    tables = [(m, table, dict(getattr(m, table))) for m in modules for table in ("_parameters", "_buffers")]
    with _RefuseWrites(storages, what) if storages else contextlib.nullcontext():
        yield
    changed = [name for m, table, before in tables for name in set(before) | set(getattr(m, table))
               if getattr(m, table).get(name) is not before.get(name)]
    if changed:
        for m, table, before in tables:
            getattr(m, table).clear()
            getattr(m, table).update(before)
        raise PlanError(f"{what} re-assigned {sorted(changed)} while keyinit planned (put back); a module rule "
                        f"must only return initializers")
