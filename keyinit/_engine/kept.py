"""``materialize`` initializes the tensors on the meta device and keeps the others, as torchdistx's
``materialize_module`` does: weights loaded into a meta model with ``load_state_dict(sd, assign=True)``
(the standard way to load into one) keep their values, and the report's notes say which tensors were
kept (their source is ``kept``). A model with nothing on meta (``materialize`` called twice) is refused."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

from keyinit._engine.escape import derived_attributes
from keyinit._engine.planned import ModelPlan, PlannedTensor
from keyinit.errors import PlanError

__all__ = ["on_meta", "refuse_allocated", "keep_allocated", "to_empty_except", "recompute_derived"]


def on_meta(tensor: torch.Tensor) -> bool:
    """``tensor`` (its local shard, for a DTensor) holds no memory."""
    return getattr(tensor, "_local_tensor", tensor).device.type == "meta"


def refuse_allocated(model: object) -> None:
    """``materialize``'s argument checks: a module, with a tensor on meta if it has any tensor."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"materialize expects an nn.Module, got {type(model).__name__}")
    tensors = [*model.parameters(), *model.buffers()]
    if tensors and not any(on_meta(t) for t in tensors):
        raise PlanError("materialize: no parameter or buffer of the model is on the meta device (materialized "
                        "already?); materialize initializes the tensors on meta and keeps the others. To "
                        "initialize an allocated model again, call keyinit.init_model(model, seed)")


def keep_allocated(plan: ModelPlan) -> list[PlannedTensor]:
    """The planned tensors not on the meta device: left out of the writing (their source is ``kept``),
    named in the plan's notes; returned for :func:`to_empty_except`."""
    kept = [t for t in plan.tensors if not (t.new or t.recreated) and not on_meta(t.tensor)]
    for t in kept:
        t.program = None
    if kept:
        plan.notes = (*plan.notes, f"kept {len(kept)} tensors that were not on the meta device as they were "
                      f"(loaded with load_state_dict(..., assign=True), or materialized before): "
                      f"{', '.join(t.fqn for t in kept[:8])}{' ...' if len(kept) > 8 else ''}")
    return kept


def to_empty_except(model: torch.nn.Module, kept: Sequence[PlannedTensor], device: Union[torch.device, str],
                    *, base: bool = False) -> None:
    """``model.to_empty(device=device)`` (``base``: ``nn.Module``'s own, not an override), except that
    the ``kept`` tensors stay as they are, and a parameter's gradient hooks (a constructor's
    ``w.register_hook(lambda g: g * mask)``) carry over to the tensor that replaces it."""
    hooked = [(module, name, p, dict(p._backward_hooks or {}), dict(p._post_accumulate_grad_hooks or {}))
              for module in model.modules() for name, p in module._parameters.items()
              if p is not None and (p._backward_hooks or p._post_accumulate_grad_hooks)]
    if not kept:
        (torch.nn.Module.to_empty if base else type(model).to_empty)(model, device=device)
    else:
        keep = {id(getattr(m, a)) for t in kept for m, a in t.locations()}
        model._apply(lambda t: t if id(t) in keep else torch.empty_like(t, device=device))
    for module, name, old, hooks, post in hooked:  # a new Parameter (meta -> cpu): the old one's gradient hooks
        new = module._parameters.get(name)
        if new is not None and new is not old and new.requires_grad:
            for hook in hooks.values():
                new.register_hook(hook)
            for hook in post.values():
                new.register_post_accumulate_grad_hook(hook)


def recompute_derived(model: torch.nn.Module) -> None:
    """The ``weight`` that torch's hook-based ``weight_norm``, ``spectral_norm`` or pruning keeps in a plain
    attribute, computed from the materialized parameters as the hook computes it (still on meta until now)."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for module in model.modules():
        for name, hook in derived_attributes(module).items():
            if not on_meta(vars(module).get(name, torch.empty(0))):
                continue
            if isinstance(hook, WeightNorm):
                value = hook.compute_weight(module)
            elif isinstance(hook, SpectralNorm):
                value = hook.compute_weight(module, do_power_iteration=False)
            else:
                value = hook.apply_mask(module)
            object.__setattr__(module, name, value)
