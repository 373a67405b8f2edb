"""Recomputes that no checkpoint hands to keyinit, run in a ``backward()`` after their keyed block: keyed as the
execution they repeat, or their draws refused naming the module.

torch's, transformers' and megatron's checkpoints and ``keyinit.nn.checkpoint`` hand their recompute to keyinit
(:mod:`keyinit.nn._recompute.checkpoint`); another library's (DeepSpeed's activation checkpointing) or a hand-written
``torch.autograd.Function`` that reruns a module's forward in backward does not. keyinit sees its first
execution only as a module of the model run inside an ``autograd.Function``'s forward (which turns autograd
and forward-mode AD off; ``torch.no_grad()`` alone leaves forward-mode AD on, and nothing recomputes it) or
under saved-tensor hooks, with no checkpoint it knows around it
(:func:`keyinit.nn._recompute.checkpoint.unguarded`). Inside the block, the block's hooks find such a recompute by its
inputs; after the block, nothing of keyinit is on the model. So while such a block lives (its forwards'
autograd graph holds it), :func:`watch` keeps two process-wide module hooks
(``torch.nn.modules.module.register_module_forward_pre_hook`` and ``register_module_forward_hook``): a module
called in backward that no keyinit hook keys, and that is one of a watched block's modules, runs as that
block's recompute (``Keyed.recomputing``, the block's hooks back on the model for the call) when exactly one
execution of theirs matches its inputs (the same tensors, or their memory, as torch's reentrant checkpoint
is matched); where none or several match, its draws (and its children's) are refused, naming the module.
The hooks hold the blocks weakly, and are taken off once no watched block is left. While they are on, every
module call in the process takes torch's hook path and this check (about 3 us a call on this machine's CPU,
1.4x a ``Linear(4, 4)`` call): only for blocks whose modules ran inside an ``autograd.Function``'s forward
or under saved-tensor hooks with no checkpoint keyinit knows (``save_on_cpu`` too), until their graph is
freed.

The module's keyword arguments are not passed to torch's global pre-hooks: a recompute is matched by its
positional tensors.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
import torch.nn.modules.module as torch_module

from keyinit.nn._forward.dropout import DropoutForward

__all__ = ["watch", "UNHANDED", "several"]

#: Why the draws of a module that a checkpoint keyinit was not handed recomputes, matching no execution, are refused.
UNHANDED = (
    "in backward, after its keyed block: a checkpoint that did not hand its recompute to keyinit (not "
    "torch.utils.checkpoint, transformers' gradient checkpointing, megatron's tensor_parallel.checkpoint or "
    "keyinit.nn.checkpoint: DeepSpeed's activation checkpointing, or an autograd.Function of your own that reruns "
    "the forward in backward) recomputes this module, and keyinit cannot match the recompute to the execution it "
    "repeats (a recompute is matched by its positional input tensors: these are neither that execution's "
    "tensors nor their memory), so it cannot give it that execution's keys. Checkpoint the module with "
    "torch.utils.checkpoint (checkpoint(module, x)) or the function with keyinit.nn.checkpoint, whose "
    "recomputes keyinit keys as their first execution"
)


def several(blocks: list) -> str:
    """Why the draws of such a recompute are refused when it matches an execution of each of ``blocks``."""
    names = ", ".join(repr(b) for b in blocks)
    return (
        f"in backward, after its keyed block: a checkpoint that did not hand its recompute to keyinit recomputes "
        f"this module on inputs that executions of several blocks ran it on ({names}), so keyinit cannot tell "
        "which execution it repeats, nor give it that execution's keys. Run each block's backward() before the "
        "next block runs the module on the same tensors, or checkpoint with torch.utils.checkpoint or "
        "keyinit.nn.checkpoint"
    )


_lock = threading.Lock()
_watched: list = []  # weak references to the watched contexts, oldest first
_handles: list = []  # the two global hooks, while any is watched
_stale = [False]  # a watched context was freed: prune at the next module call
_running = threading.local()  # .stack: [module, leave, depth] of the recomputes these hooks opened, innermost last
_graph_task = torch._C._current_graph_task_id
_compiling = torch.compiler.is_compiling


def _freed(_: Any) -> None:
    _stale[0] = True  # (only a flag: a weakref callback may run inside torch's loop over the hooks)


def watch(ctx: Any) -> None:
    """Watch for recomputes of ``ctx``'s forwards that no checkpoint hands to keyinit (see the module docstring),
    while ``ctx`` lives."""
    with _lock:
        _watched.append(weakref.ref(ctx, _freed))
        if not _handles:
            _handles.append(torch_module.register_module_forward_pre_hook(_pre_hook))
            _handles.append(torch_module.register_module_forward_hook(_post_hook, always_call=True))


def _contexts() -> list:
    """The watched contexts still alive, oldest first; the hooks are taken off when none is (called from the hooks
    themselves, where torch has already read its table of global hooks)."""
    with _lock:
        if _stale[0]:
            _stale[0] = False
            _watched[:] = [ref for ref in _watched if ref() is not None]
            if not _watched and not getattr(_running, "stack", None):
                for handle in _handles:
                    handle.remove()
                _handles.clear()
        return [ctx for ctx in (ref() for ref in _watched) if ctx is not None]


def _keyinit_hooked(module: torch.nn.Module) -> bool:
    """A keyed context's hooks (or its dropout forward) are on ``module``: they decide about this call."""
    if isinstance(module.__dict__.get("forward"), DropoutForward):
        return True
    return any(getattr(hook, "_keyinit_hook", False) for hook in module._forward_pre_hooks.values())


def _pre_hook(module: torch.nn.Module, args: tuple) -> None:
    if _compiling():
        return  # (dynamo traces a forward: nothing to do, and nothing it cannot trace)
    if _stale[0]:
        _contexts()
    if _graph_task() == -1:
        return  # not in backward
    stack = getattr(_running, "stack", None)
    if stack:
        if stack[-1][0] is module:
            stack[-1][2] += 1  # (the module calls itself)
        return  # inside a recompute opened here: its context's hooks are on its model
    if _keyinit_hooked(module):
        return
    found = [(ctx, planned) for ctx in _contexts() if (planned := ctx.planned(module)) is not None]
    if not found:
        return
    matched = [(ctx, planned) for ctx, planned in found if ctx.repeats(module, planned[0], args)]
    refuse: Optional[str] = None
    if len(matched) == 1:
        ctx, (fqn, light) = matched[0]
    else:
        ctx, (fqn, light) = found[-1]
        refuse = UNHANDED if not matched else several([c for c, _ in matched])
    leave = ctx.recompute_unhanded(module, fqn, light, args, refuse)
    if stack is None:
        stack = _running.stack = []
    stack.append([module, leave, 0])


def _post_hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
    if _compiling():
        return
    stack = getattr(_running, "stack", None)
    if not stack or stack[-1][0] is not module:
        return
    top = stack[-1]
    if top[2]:
        top[2] -= 1
        return
    stack.pop()
    top[1](output)
