"""torch.func's wrapped tensors as a keyed forward sees them: records keyed on the values under the wrappers.

Under ``torch.func.grad``/``vjp``/``jacrev``/``vmap`` the model's Python code holds wrapper tensors (a
``GradTrackingTensor`` per grad level, a ``BatchedTensor`` per vmap level), while the dispatch mode
(:class:`keyinit.nn._forward.modes.BatchMode`) sees the plain tensors under them. A grad wrapper has its value's
shape, so its batch record is its value's (:func:`unwrapped`). A vmap level hides one dimension of its
value: the samples of ``vmap`` over a batch are that dimension (:func:`vmap_levels`), so a keyed draw on
a vmapped tensor is made on the physical tensor (every sample's row of the batched forward) and wrapped
back at the same level (:func:`vmapped_mask`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["wrapped", "unwrapped", "vmap_levels", "vmapped_mask"]

_F = torch._C._functorch
wrapped = _F.is_functorch_wrapped_tensor
_is_batched = _F.is_batchedtensor
_get_unwrapped = _F.get_unwrapped


def unwrapped(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The plain tensor under ``tensor``'s grad wrappers (the one the dispatch mode sees), or None when a
    vmap level is among them (its shape is not the wrapper's) or ``tensor`` is not wrapped."""
    inner = tensor
    while wrapped(inner):
        if _is_batched(inner):
            return None
        inner = _get_unwrapped(inner)
    return inner if inner is not tensor else None


def vmap_levels(tensor: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """``(physical, [(level, bdim), ...])``: the plain tensor under every wrapper of ``tensor`` and its vmap
    levels from the outermost in (``bdim``: the dimension of the value under that level that it maps)."""
    levels: list[tuple[int, int]] = []
    inner = tensor
    while wrapped(inner):
        if _is_batched(inner):
            levels.append((_F.maybe_get_level(inner), _F.maybe_get_bdim(inner)))
        inner = _get_unwrapped(inner)
    return inner, levels


def vmapped_mask(keep: torch.Tensor, level: int, bdim: int) -> torch.Tensor:
    """The physical keep mask ``keep`` wrapped as a tensor of vmap level ``level`` mapping dimension ``bdim``."""
    return _F._add_batch_dim(keep, bdim, level)


def describe(tensor: Any) -> str:
    """``"a tensor of torch.func.vmap"`` and the like, for messages."""
    _, levels = vmap_levels(tensor)
    return f"a tensor of {len(levels)} nested torch.func.vmap levels" if len(levels) > 1 else \
        "a tensor of torch.func.vmap"


def root_inputs(tensors: list) -> tuple[list, list]:
    """``(tensors, vmapped)`` of a root forward's input tensors: each one vmapped replaced by its physical tensor,
    whose samples are the dimension its vmap level maps (in ``vmapped``; None for the others)."""
    found, dims = [], []
    for t in tensors:
        if wrapped(t) and unwrapped(t) is None:
            physical, levels = vmap_levels(t)
            if len(levels) > 1:
                raise TypeError(
                    f"keyinit.nn.keyed: the model is called on {describe(t)} (vmap inside vmap): keyinit keys one "
                    "vmap level over the samples of a batch; call the model on the batch, or vmap once over it")
            found.append(physical)
            dims.append(levels[0][1])
        else:
            found.append(t)
            dims.append(None)
    return found, dims
