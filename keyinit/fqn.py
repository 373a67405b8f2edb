"""Canonical FQNs: the names keys are derived from.

The canonical FQN of a tensor is its name in the model's DCP state dict:
``named_parameters`` with wrapper modules stripped. Wrappers that insert a
path component are ``torch.compile``'s ``_orig_mod``, FSDP1's
``_fsdp_wrapped_module``, activation checkpointing's
``_checkpoint_wrapped_module``, and DDP/DataParallel's ``module``. So
compiling, checkpointing or wrapping a model never changes its values.

megatron-core experts under expert parallelism: an experts module (``SequentialMLP``)
numbers its ``local_experts`` from 0 on every expert-parallel rank; their canonical
names use the GLOBAL expert index (``...experts.local_experts.<global index>...``),
``ep_group.rank() * num_local_experts + local index``, as megatron's distributed
checkpoint does. So expert parameters are keyed the same under any expert parallelism.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Callable, Optional, Union

import torch

from keyinit._sharding.megatron import expert_child_names

__all__ = ["WRAPPER_ATTRIBUTES", "canonical_modules", "FqnMap"]

WRAPPER_ATTRIBUTES = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

FqnMap = Union[Mapping[str, str], Callable[[str], str]]


def is_data_parallel(module: torch.nn.Module) -> bool:
    return isinstance(module, _parallel_types())


@functools.lru_cache(maxsize=None)
def _parallel_types() -> tuple[type, ...]:
    """DataParallel and DistributedDataParallel (looked up once: every module of a walk asks)."""
    parallel_types: list[type] = [torch.nn.DataParallel]
    try:
        from torch.nn.parallel import DistributedDataParallel

        parallel_types.append(DistributedDataParallel)
    except ImportError:  # pragma: no cover - torch builds without distributed
        pass
    return tuple(parallel_types)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def canonical_modules(root: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Module]]:
    """Yield ``(raw_name, canonical_name, module)`` for every module, parents first.

    Shared submodules are yielded once per path, like
    ``named_modules(remove_duplicate=False)``.
    """

    # depth first, parents first, children in order: an explicit stack (a recursive generator resumes every
    # level above a module for each module it yields)
    stack: list[tuple[torch.nn.Module, str, str, Optional[Mapping[str, str]]]] = [(root, "", "", None)]
    while stack:
        module, raw, canonical, renamed = stack.pop()
        yield raw, canonical, module
        experts = expert_child_names(module, canonical)  # megatron-core: {local: global expert index}
        children = module._modules
        if not children:
            continue
        strip_module = is_data_parallel(module)
        below = []
        for name, child in children.items():
            if child is None:
                continue
            stripped = name in WRAPPER_ATTRIBUTES or (strip_module and name == "module")
            child_canonical = canonical if stripped else _join(canonical, renamed.get(name, name) if renamed else name)
            below.append((child, _join(raw, name), child_canonical,
                          experts if experts is not None and name == "local_experts" else None))
        stack.extend(reversed(below))


def apply_fqn_mapping(fqn: str, prefix: Optional[str], mapping: Optional[FqnMap]) -> str:
    """Turn a stage-local canonical FQN into the full model's FQN (pipeline stages)."""
    if mapping is not None:
        if callable(mapping):
            fqn = mapping(fqn)
        elif fqn in mapping:
            fqn = mapping[fqn]
        if not isinstance(fqn, str) or not fqn:
            raise ValueError(f"fqn_map produced {fqn!r}; expected a non-empty str")
    if prefix:
        fqn = _join(prefix.rstrip("."), fqn)
    return fqn
