"""The one walk over a model's tensors: canonical FQNs, ties, global shapes, pipeline-stage cuts.

:func:`tensors` lists every distinct parameter and buffer of a model once, in module order,
named by its first canonical FQN (:func:`keyinit.fqn.canonical_modules`: wrappers stripped,
megatron experts by global index) with every other location it is reachable under (tied
weights). Planning (:mod:`keyinit._engine.planning.plan`), ``keyinit verify``, ``slice`` and ``demo`` all walk
a model through it.

:func:`stage_blocks` is the one rule that splits ``n`` blocks into ``stages`` contiguous
runs: the first ``n % stages`` stages get one block more. :func:`stage_assignment` and
:func:`cut_stage` apply it to a model, torchtitan style, keeping FQNs.
"""

from __future__ import annotations

import math
from typing import Optional

import attrs
import torch

from keyinit.fqn import canonical_modules

__all__ = ["ModelTensor", "tensors", "aliases", "stage_blocks", "stage_assignment", "cut_stage", "StageError"]


class StageError(ValueError):
    """A model that cannot be cut into the requested number of pipeline stages."""


@attrs.define(eq=False)
class ModelTensor:
    """One distinct tensor of a model: its first canonical FQN, every ``(module, attr, fqn)``
    location it is reachable under (the first is its owner), and its global metadata."""

    fqn: str
    kind: str  # "parameter" or "buffer"
    locations: list[tuple[torch.nn.Module, str, str]]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    #: every canonical FQN it is reachable under, first first (a shared submodule gives one
    #: location several names); empty: the names of ``locations``
    all_names: list[str] = attrs.Factory(list)

    @property
    def module(self) -> torch.nn.Module:
        return self.locations[0][0]

    @property
    def attr(self) -> str:
        return self.locations[0][1]

    @property
    def names(self) -> list[str]:
        """Every canonical FQN of the tensor, first name first, each once."""
        return list(self.all_names) or list(dict.fromkeys(name for _, _, name in self.locations))

    @property
    def tensor(self) -> torch.Tensor:
        return getattr(self.module, self.attr)


def tensors(model: torch.nn.Module) -> list[ModelTensor]:
    """Every distinct parameter and buffer of ``model``, named by its first canonical FQN, in
    module order (parents first, each module's parameters before its buffers)."""
    by_id: dict[int, ModelTensor] = {}
    order: list[ModelTensor] = []
    for _raw, canonical, module in canonical_modules(model):
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for attr, tensor in table.items():
                if tensor is None:
                    continue
                fqn = f"{canonical}.{attr}" if canonical else attr
                entry = by_id.get(id(tensor))
                if entry is None:
                    entry = ModelTensor(fqn, kind, [], tuple(tensor.shape), tensor.dtype, bool(tensor.requires_grad))
                    by_id[id(tensor)] = entry
                    order.append(entry)
                if all(m is not module or a != attr for m, a, _ in entry.locations):
                    entry.locations.append((module, attr, fqn))
                if fqn not in entry.all_names:
                    entry.all_names.append(fqn)
    return order


def aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias fqn: first fqn}`` for tensors reachable under several canonical names (tied weights)."""
    return {name: t.fqn for t in tensors(model) for name in t.names[1:]}


def stage_blocks(names: list[str], stages: int) -> list[list[str]]:
    """``names`` split into ``stages`` contiguous runs, the first ``len(names) % stages`` one longer."""
    per, extra = divmod(len(names), stages)
    runs, start = [], 0
    for stage in range(stages):
        count = per + (stage < extra)
        runs.append(names[start:start + count])
        start += count
    return runs


def _block_container(model: torch.nn.Module) -> Optional[tuple[str, torch.nn.Module]]:
    """The model's block stack, where torchtitan cuts its stages: of the ModuleLists, ModuleDicts and
    Sequentials whose children with parameters are two or more blocks of one class (nanoGPT's
    ``transformer.h``, timm's ``blocks``), the one holding the most parameters. Without one, the
    ModuleList/ModuleDict holding the most parameters."""
    stacks: list[tuple[int, str, torch.nn.Module]] = []
    lists: list[tuple[int, str, torch.nn.Module]] = []
    for _raw, canonical, module in canonical_modules(model):
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)) \
                or not module._modules:
            continue
        numel = sum(math.prod(p.shape) for p in module.parameters())
        blocks = [c for c in module._modules.values() if c is not None and any(True for _ in c.parameters())]
        if len(blocks) >= 2 and len({type(c) for c in blocks}) == 1:
            stacks.append((numel, canonical, module))
        if not isinstance(module, torch.nn.Sequential):
            lists.append((numel, canonical, module))
    for found in (stacks, lists):
        if found:
            best = max(found, key=lambda entry: entry[0])  # the first of equals: model order
            return best[1], best[2]
    return None


def stage_assignment(model: torch.nn.Module, found: list[ModelTensor], stages: int) -> dict[str, int]:
    """``{fqn: stage}`` of every location of ``found``: the blocks of the model's block stack
    (:func:`_block_container`) split by :func:`stage_blocks`; tensors before it go to the first
    stage, after it to the last.
    Without such a container, the root's children that hold parameters are the blocks."""
    container = _block_container(model)
    if container is None or len(container[1]._modules) < stages:
        children = [n for n, c in model._modules.items() if c is not None and any(True for _ in c.parameters())]
        if len(children) < stages:
            raise StageError(f"pp{stages}: cannot split the model into {stages} stages: no nn.ModuleList/ModuleDict "
                             f"and only {len(children)} top-level submodules with parameters")
        container = ("", model)
    prefix, holder = container
    names = [n for n, c in holder._modules.items()
             if c is not None and (holder is not model or any(True for _ in c.parameters()))]
    block_stage = {name: stage for stage, run in enumerate(stage_blocks(names, stages)) for name in run}
    assignment: dict[str, int] = {}
    seen_block = False
    block_prefix = f"{prefix}." if prefix else ""
    for t in found:
        for _module, _attr, fqn in t.locations:
            if fqn.startswith(block_prefix):
                block = fqn[len(block_prefix):].split(".", 1)[0]
                if block in block_stage:
                    assignment[fqn] = block_stage[block]
                    seen_block = True
                    continue
            assignment[fqn] = stages - 1 if seen_block else 0
    return assignment


def cut_stage(model: torch.nn.Module, found: list[ModelTensor], assignment: dict[str, int],
              stage: int) -> list[ModelTensor]:
    """Cut ``model`` in place to pipeline stage ``stage``, torchtitan style, keeping FQNs.

    A submodule whose tensors all belong to other stages is removed: deleted from a
    ModuleList/ModuleDict/Sequential (the other entries keep their names) or set to None in
    any other parent (``model.tok_embeddings = None``). Remaining tensors of other stages are
    deleted from their module. Returns the kept tensors, with only their kept locations.
    """
    owned_ids: dict[int, bool] = {}
    for t in found:
        for module, _attr, fqn in t.locations:
            owned_ids[id(module)] = owned_ids.get(id(module), False) or assignment[fqn] == stage

    def owns_any(module: torch.nn.Module) -> Optional[bool]:
        """True if ``module``'s subtree holds a tensor of this stage; None if it holds no tensors at all."""
        any_tensor = False
        for sub in module.modules():
            if id(sub) in owned_ids:
                any_tensor = True
                if owned_ids[id(sub)]:
                    return True
        return False if any_tensor else None

    def prune(module: torch.nn.Module) -> None:
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            if owns_any(child) is False:
                if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
                    module._modules.pop(name)
                else:
                    module._modules[name] = None
            else:
                prune(child)

    prune(model)
    kept = []
    for t in found:
        locations = []
        for module, attr, fqn in t.locations:
            if assignment[fqn] == stage:
                locations.append((module, attr, fqn))
            else:
                (module._parameters if t.kind == "parameter" else module._buffers).pop(attr, None)
        if locations:
            kept.append(ModelTensor(locations[0][2], t.kind, locations, t.shape, t.dtype, t.requires_grad))
    return kept
