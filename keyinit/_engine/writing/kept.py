"""Which tensors ``materialize`` keeps: the ones the user loaded into the meta model, decided while planning.

Weights loaded into a meta model with ``load_state_dict(sd, assign=True)`` (the standard way to load into
one) are real tensors among meta ones, and keep their values, as torchdistx's ``materialize_module`` does;
the report's notes say which tensors were kept (their source is ``kept``). But "not on meta" alone does
not mean loaded: a constructor run under ``torch.device("meta")`` makes real tensors with the functions
that ignore the device (HF DiffLlama's ``torch.normal(0, std, size=...)``, drawn from torch's global RNG),
and its init code then overwrites them. So a real tensor that captured init code writes is kept only when
the user says it was loaded (``materialize(..., loaded=...)``: exactly those are kept, everything else
keyinit covers is written); without that it is a :class:`PlanError` naming the tensors, before anything is
allocated. A module built by ``keyinit.deferred`` has only meta tensors when its constructor returns, so
its real tensors were assigned since and are kept. A model with nothing on meta (``materialize`` called
twice) is refused."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Optional, Union

import torch

from keyinit._engine.deferred.deferred import record_of
from keyinit._engine.capture.escape import derived_attributes
from keyinit._engine.planning.planned import ModelPlan, PlannedTensor
from keyinit.errors import PlanError

__all__ = ["on_meta", "refuse_allocated", "loaded_names", "keep_allocated", "to_empty_except", "recompute_derived"]

Loaded = Union[Mapping[str, object], Iterable[str], None]


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


def loaded_names(loaded: Loaded) -> Optional[frozenset[str]]:
    """``materialize``'s ``loaded=``: a state dict (its keys) or FQNs; ``None`` (not said) stays ``None``."""
    if loaded is None:
        return None
    if isinstance(loaded, (str, bytes)) or not isinstance(loaded, Iterable):
        raise TypeError(f"materialize: loaded= takes the state dict you loaded or an iterable of FQNs, got "
                        f"{type(loaded).__name__}")
    names = list(loaded.keys() if isinstance(loaded, Mapping) else loaded)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"materialize: loaded= takes FQNs (str), got {bad[0]!r}")
    return frozenset(names)


def keep_allocated(plan: ModelPlan, loaded: Optional[frozenset[str]], strict: bool = True) -> list[PlannedTensor]:
    """The planned tensors ``materialize`` keeps as they are (their program dropped: their source is
    ``kept``), named in the plan's notes. ``loaded`` (the FQNs the user loaded, ``None`` when not said):
    exactly those are kept, with the real tensors nothing covers; not said, a real tensor is kept unless
    captured init code writes it in a module not built by ``keyinit.deferred`` (a constructor may have
    drawn it): that is a :class:`PlanError` asking which. Returned for :func:`to_empty_except`."""
    real = [t for t in plan.tensors if not (t.new or t.recreated) and not on_meta(t.tensor)]
    if loaded is None:
        unsure = [t for t in real if t.program is not None and t.origin in ("code", "constructor")
                  and record_of(t.module) is None]
        if unsure:
            names = ", ".join(t.fqn for t in unsure[:8]) + (" ..." if len(unsure) > 8 else "")
            raise PlanError(
                f"materialize: {len(unsure)} tensors are not on the meta device although the init code writes "
                f"them: {names}. A constructor run under torch.device('meta') makes real tensors with "
                f"functions that ignore it (torch.normal(mean, std, size=...), drawn from torch's global RNG), "
                f"and weights loaded with load_state_dict(..., assign=True) are real too; keyinit cannot tell "
                f"which these are. Say which you loaded: materialize(..., loaded=<the state dict or FQNs you "
                f"loaded>) keeps exactly those and writes the rest, loaded=() writes them all (or build the "
                f"model with keyinit.deferred, whose constructor leaves every tensor on meta)",
                tuple(t.fqn for t in unsure))
        kept = real
    else:
        by_name = {name: t for t in plan.tensors for name in (t.fqn, *t.names)}
        unknown = sorted(n for n in loaded if n not in by_name)
        if unknown and strict:
            raise PlanError(f"materialize: loaded= names {unknown[:8]}{' ...' if len(unknown) > 8 else ''}, "
                            f"which the model has no tensor of (strict=False ignores them)", tuple(unknown))
        still_meta = sorted(n for n in loaded if n in by_name and on_meta(by_name[n].tensor))
        if still_meta:
            raise PlanError(f"materialize: loaded= names {still_meta[:8]}{' ...' if len(still_meta) > 8 else ''}, "
                            f"which are still on the meta device (loading into a meta model needs "
                            f"load_state_dict(..., assign=True))", tuple(still_meta))
        declared = {id(by_name[n]) for n in loaded if n in by_name}
        kept = [t for t in real if id(t) in declared or t.program is None]
    for t in kept:
        t.program = None
        t.origin = "kept"
    if kept:
        plan.notes = (*plan.notes, f"kept {len(kept)} tensors that were not on the meta device as they were "
                      f"(loaded with load_state_dict(..., assign=True), or materialized before): "
                      f"{', '.join(t.fqn for t in kept[:8])}{' ...' if len(kept) > 8 else ''}")
    plan.kept = kept
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
