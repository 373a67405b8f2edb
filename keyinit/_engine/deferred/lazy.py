"""Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ...) whose tensors have no shape yet: refused by name."""

from __future__ import annotations

import torch

from keyinit.errors import PlanError

__all__ = ["check_lazy"]


def check_lazy(model: torch.nn.Module, what: str) -> None:
    """A ``PlanError`` naming every module of ``model`` whose lazy tensors (``nn.LazyLinear``,
    ``nn.LazyConv2d``, ...) have no shape yet: nothing can be planned for them."""
    lazy, fqns = [], []
    for prefix, module in model.named_modules(remove_duplicate=False):
        names = [name for table in (module._parameters, module._buffers) for name, tensor in table.items()
                 if tensor is not None and torch.nn.parameter.is_lazy(tensor)]
        if names:
            fqns += [f"{prefix}.{name}" if prefix else name for name in names]
            lazy.append(f"{prefix or '<root>'} ({type(module).__name__}: {', '.join(names)})")
    if lazy:
        raise PlanError(
            f"{what}: lazy module {'; '.join(lazy)} not initialized yet: its tensors have no shape until its first "
            f"forward. Run a forward on a sample input first, or build it with its sizes (nn.Linear(in_features, "
            f"out_features) instead of nn.LazyLinear(out_features))", tuple(fqns))
