"""Activation checkpointing of functions: ``keyinit.nn.checkpoint``'s keyed recompute, and the draws keyinit
could not follow into torch's own recompute (refused at the first execution).

keyed() finds a recompute by its module: a module that runs in backward is matched
to the execution it repeats by its inputs (:func:`keyinit.nn._forward.pieces.recomputed`).
That covers ``checkpoint(module, x)``, ``checkpoint_wrapper`` and transformers'
gradient checkpointing. A *function* checkpointed with ``torch.utils.checkpoint``
inside a module's forward is recomputed in backward with keyed()'s modes off until
it calls a module of the model, so:

- a draw it makes itself (``torch.rand_like(y)``, ``F.dropout(y)`` written in the
  function, not in a module) would be recomputed with torch's generator: refused
  at the first execution (:func:`unseen_recompute`), before any wrong gradient;
- a module it calls on tensors it computed (``drop(y * 2)``) cannot be matched:
  its draws are refused in backward (``keyinit.nn._context.frames.UNMATCHED_RECOMPUTE``).

:class:`Region` is what ``keyinit.nn.checkpoint`` hands torch's checkpoint instead of
the function: its first call is the first execution; a later call (the recompute,
reentrant or not, in backward, in this thread or autograd's) runs the function again
as that execution, in the frame of the module that called ``checkpoint``, with the
call ordinals, host generator states and input batch records it began with.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch

from keyinit.nn._batch.records import annotate, record

__all__ = ["Region", "Recompute", "hand_recomputes", "unseen_recompute", "refuse_unseen", "UNSEEN_RECOMPUTE"]

_TORCH_CHECKPOINT = os.path.join("torch", "utils", "checkpoint.py")
# megatron-core's own activation checkpointing: CheckpointFunction (and CheckpointWithoutOutputFunction) run the
# function in their forward and recompute it in backward, as torch's reentrant checkpoint does
_MEGATRON_CHECKPOINT = os.path.join("megatron", "core", "tensor_parallel", "random.py")
_MODULE_CALL = os.path.join("torch", "nn", "modules", "module.py")
_THIS = __file__
# transformers' keyed checkpointing (its run)
_FORWARD = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_forward", "pieces.py")
_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks

#: The end of the error of a draw :func:`unseen_recompute` finds.
UNSEEN_RECOMPUTE = (
    "inside torch.utils.checkpoint (or megatron's tensor_parallel.checkpoint) of a function that this module's "
    "own code checkpoints (the draw is in the function, not in a module of the model it calls): backward "
    "recomputes that function with keyed()'s modes "
    "off until it calls a module, so this draw would be made again from torch's generator, not with its key, "
    "and the gradients would be wrong. Checkpoint the function with keyinit.nn.checkpoint (same arguments as "
    "torch's), whose recompute is keyed as its first execution, or move the draw into a module"
)


def unseen_recompute(frame: Any) -> bool:
    """A draw now, made in ``frame``'s module's own code (not in a module it calls) inside the first execution of
    ``torch.utils.checkpoint`` (or megatron-core's ``tensor_parallel.checkpoint``): it is recomputed in backward
    where keyed() does not see it.

    Looked for only under checkpointing's conditions (autograd off inside a forward that had it on, or
    saved-tensor hooks set): the Python stack, from the draw up to the nearest module call, passes through
    ``torch/utils/checkpoint.py`` (or the ``forward`` of megatron's checkpoint functions) and through no keyed
    recompute (:class:`Region`, transformers' wrapper).
    """
    if not (frame.forward.grad and not torch.is_grad_enabled()) and _saved_tensor_hooks(False) is None:
        return False
    f: Optional[Any] = sys._getframe(1)
    depth = 0
    while f is not None and depth < 400:
        code = f.f_code
        filename = code.co_filename
        if filename == _THIS and code.co_name == "__call__":
            return False  # a keyinit.nn.checkpoint region: recomputed keyed
        if filename == _FORWARD and code.co_name == "run":
            return False  # transformers' checkpointing, wrapped by keyed (CheckpointingFunction)
        if filename.endswith(_TORCH_CHECKPOINT):
            return True
        if filename.endswith(_MEGATRON_CHECKPOINT) and code.co_name == "forward":
            return True  # megatron's CheckpointFunction.forward (its first execution, autograd off)
        if filename.endswith(_MODULE_CALL):
            return False  # the call of the module the draw is in: checkpointing above it recomputes the module
        f = f.f_back
        depth += 1
    return False


def refuse_unseen(frame: Any, what: str) -> None:
    """Raise the :class:`~keyinit.errors.UnkeyedRandomnessError` of a draw ``what`` where
    :func:`unseen_recompute` finds one."""
    if unseen_recompute(frame):
        from keyinit.errors import UnkeyedRandomnessError

        raise UnkeyedRandomnessError(f"{frame.describe()}: {what} {UNSEEN_RECOMPUTE}")


class Region:
    """The function ``keyinit.nn.checkpoint`` checkpoints, as torch's checkpoint calls it (see the module
    docstring): where its first execution began in the keyed forward, and the recompute keyed as it."""

    __slots__ = ("ctx", "function", "forward", "module", "fqn", "counts", "host", "firsts", "calls")

    def __init__(self, ctx: Any, frame: Any, function: Any, args: tuple) -> None:
        self.ctx, self.function = ctx, function
        self.forward, self.module, self.fqn = frame.forward, frame.module, frame.fqn
        self.counts = dict(frame.counts)  # the call ordinals taken before the function began
        host = frame.forward.host  # where the forward's host generators stood (None: as seeded)
        self.host = host.state() if host is not None and host.moved() else None
        self.firsts = args
        self.calls = 0
        ctx._recomputable = True  # a forward ran under checkpointing: the context's hooks and records stay after
        # the block while its tensors live (keyinit.nn._context.keyed.Keyed.__exit__)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:  # the first execution, inside the keyed forward
            return self.function(*inputs, **kwargs)
        forward = self.forward
        for new, old in zip(inputs, self.firsts):  # reentrant checkpointing passes detached copies
            if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and new is not old:
                annotate(new, forward, record(old, forward))
        with self.ctx.recomputing():
            frame = self.ctx._resume(self)
            try:
                out = self.function(*inputs, **kwargs)
            except BaseException:
                self.ctx._post_hook()(self.module, inputs, None)
                raise
            if frame is not None:
                self.ctx._post_hook()(self.module, inputs, out)
        return out


class Recompute:
    """The function a checkpoint recomputes in backward, handed over with the keyed context whose forward ran it
    first (:func:`hand_recomputes`): its call is the recompute, run inside ``ctx.recomputing()`` (the context's
    hooks on the model for that call only, when its block is over, and every other context's hooks standing
    aside). Held where the checkpoint holds its function (the autograd graph, torch's checkpoint frame), never
    by the model: it lives as long as the recompute may run."""

    __slots__ = ("ctx", "function")

    def __init__(self, ctx: Any, function: Any) -> None:
        self.ctx, self.function = ctx, function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.ctx.recomputing():
            return self.function(*args, **kwargs)


def _holder(f: Any, megatron: bool) -> tuple[Any, str]:
    """The object of the checkpoint running in Python frame ``f`` that holds its recompute function, and the
    attribute's name (``(None, "")`` where ``f`` is no such frame)."""
    name = f.f_code.co_name
    if name == "forward":  # torch's (reentrant) and megatron's CheckpointFunction.forward
        local = f.f_locals
        obj = local.get("checkpoint_without_output_obj") if megatron else None  # megatron's CheckpointWithoutOutput
        return (obj if obj is not None else local.get("ctx")), "run_function"
    if name == "checkpoint" and not megatron:  # torch's non-reentrant checkpoint: its generator holds the frame
        gen = f.f_locals.get("gen")
        inner = getattr(gen, "gi_frame", None)
        return (inner.f_locals.get("new_frame") if inner is not None else None), "recompute_fn"
    return None, ""


def hand_recomputes(ctx: Any) -> None:
    """A module of ``ctx``'s model runs under activation checkpointing: hand the recompute function of every
    checkpoint around it (torch's, reentrant or not, and megatron-core's, found on the Python stack) over as a
    :class:`Recompute` of ``ctx``. The innermost first; where one is handed already, so are those around it."""
    f: Optional[Any] = sys._getframe(2)
    depth = 0
    while f is not None and depth < 400:
        filename = f.f_code.co_filename
        megatron = filename.endswith(_MEGATRON_CHECKPOINT)
        if megatron or filename.endswith(_TORCH_CHECKPOINT):
            holder, attr = _holder(f, megatron)
            function = getattr(holder, attr, None) if holder is not None else None
            if isinstance(function, Recompute):
                return
            if function is not None:
                setattr(holder, attr, Recompute(ctx, function))
        f = f.f_back
        depth += 1
