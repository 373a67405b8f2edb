"""What planning decides: a model's tensors, each with its program, and the plan that writes them.

:class:`PlannedTensor` is one tensor of the model (a tied tensor is one entry with several names),
where it lives, what covers it and the program that gives its values. :class:`ModelPlan` holds
them with the keys :func:`keyinit._engine.programs.program.assign_keys` gave their draws, and writes any region of
any tensor (:meth:`ModelPlan.write`). :mod:`keyinit._engine.planning.plan` makes them; the init code runner
(:mod:`keyinit._engine.planning.init_code`), the writer (:mod:`keyinit.model`) and the CLI read them. This module
sits below all of them, so none imports another to name these types.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import attrs
import torch

from keyinit import layouts
from keyinit.keys import Key
from keyinit._engine.programs.program import Node, SlotProgram, assign_keys
from keyinit._engine.programs.replay import Evaluator, element_local, write_target

__all__ = ["ModelPlan", "PlannedTensor"]


@attrs.define(eq=False)
class PlannedTensor:
    """One tensor of the model (a tied tensor is one entry with several names) and its program."""

    fqn: str
    names: list[str]
    key_fqn: str
    kind: str  # "parameter", "buffer", or what init code created: "attribute", "buffer (not persistent)"
    module: torch.nn.Module
    module_fqn: str
    attr: str
    aliases: list = attrs.Factory(list)  # further (module, attr) locations of the same tensor
    rule: Optional[tuple[str, str, Any]] = None  # (precedence class, label, initializer)
    program: Optional[SlotProgram] = None
    global_shape: tuple[int, ...] = ()
    dtype: Optional[torch.dtype] = None
    recreated: bool = False  # init code assigned a new tensor of another shape or dtype
    origin: str = "kept"  # what the values come from: "constructor", "default", "code", "rule", "pattern" (or "kept")
    new: bool = False  # init code created it (a new attribute or buffer): the writer creates the tensor
    record: Optional[Node] = None  # its value when a keyinit.deferred constructor returned

    @property
    def tensor(self) -> torch.Tensor:
        return getattr(self.module, self.attr)

    @property
    def source(self) -> str:
        if self.program is None:
            return "kept"
        return self.program.source or "kept"

    def locations(self) -> list[tuple[torch.nn.Module, str]]:
        return [(self.module, self.attr), *self.aliases]

    def distinct_alias_tensors(self) -> list[tuple[torch.nn.Module, str]]:
        """Alias locations that no longer hold the same tensor (``to_empty`` unties)."""
        first = self.tensor
        return [(m, a) for m, a in self.aliases if getattr(m, a) is not first]



class ModelPlan:
    """What :func:`keyinit._engine.planning.plan.plan_model` decided. ``tensors`` in model order; :meth:`write` writes one."""

    def __init__(self, model: torch.nn.Module, root_key: Key, seed: int, tensors: list[PlannedTensor],
                 shards: Mapping[str, Any], notes: Sequence[str]) -> None:
        self.model = model
        self.root_key = root_key
        self.seed = seed
        self.tensors = tensors
        self.shards = dict(shards)
        self.notes = tuple(notes)
        self.kept: list[PlannedTensor] = []  # what materialize keeps as it is (keyinit._engine.writing.kept.keep_allocated)
        programs = [(t.program, t.key_fqn) for t in tensors if t.program is not None]
        self.keys = assign_keys(programs, root_key)
        self.evaluator = Evaluator(self.keys)

    def target(self, tensor: PlannedTensor, module: Optional[torch.nn.Module] = None,
               attr: Optional[str] = None, *, allow_meta: bool = False) -> layouts.Target:
        module, attr = (module, attr) if module is not None else (tensor.module, tensor.attr)
        return layouts.target_for(getattr(module, attr), fqn=tensor.fqn, module=module, name=attr,
                                  shards=self.shards, allow_meta=allow_meta)

    def write(self, tensor: PlannedTensor, target: layouts.Target) -> None:
        """Write ``tensor``'s values at ``target.region`` into ``target.out``."""
        if tensor.program is None:
            raise ValueError(f"{tensor.fqn}: nothing initializes this tensor")
        write_target(self.evaluator, tensor.program, target)

    def element_local(self, tensor: PlannedTensor) -> bool:
        return tensor.program is None or element_local(tensor.program.roots())
