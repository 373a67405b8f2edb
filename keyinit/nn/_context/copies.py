"""Copies of a model made while keyinit's hooks are on it: the model as it was.

While a ``keyed()`` block (or a recompute after it) has its hooks, ``nn.Dropout`` forwards or wrapped
checkpointing functions on a model, ``torch.nn.Module.__getstate__`` (what ``torch.save``, ``pickle`` and
``copy.deepcopy`` read) is :func:`state_without_keyinit`, which leaves them out; torch's own is put back
when no context holds it (:func:`hold_getstate`). This swap is the one global change a block makes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from keyinit.nn._forward.pieces import CheckpointingFunction
from keyinit.nn._forward.dropout import DropoutForward

__all__ = ["hold_getstate", "state_without_keyinit"]

_lock = threading.Lock()
# While keyinit's hooks are on a model (a block, or a recompute after it), torch.nn.Module.__getstate__ (what
# torch.save, pickle and copy.deepcopy read) gives a module's state without them: a copy is the model as it was.
_MODULE_GETSTATE = torch.nn.Module.__getstate__
_getstate_holders = [0]
_HOOK_IDS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def state_without_keyinit(module: torch.nn.Module) -> dict:
    """torch's ``Module.__getstate__`` without keyinit's hooks, dropout forward and checkpointing wrapper."""
    state = _MODULE_GETSTATE(module)  # (a copy of the module's __dict__)
    for name in ("_forward_pre_hooks", "_forward_hooks"):
        hooks = state.get(name)
        if hooks and any(getattr(h, "_keyinit_hook", False) for h in hooks.values()):
            ours = {k for k, h in hooks.items() if getattr(h, "_keyinit_hook", False)}
            state[name] = OrderedDict((k, h) for k, h in hooks.items() if k not in ours)
            for extra in _HOOK_IDS:
                if isinstance(state.get(extra), dict):
                    state[extra] = OrderedDict((k, v) for k, v in state[extra].items() if k not in ours)
    if isinstance(state.get("forward"), DropoutForward):
        del state["forward"]
    found = state.get("_gradient_checkpointing_func")
    if isinstance(found, CheckpointingFunction):
        state["_gradient_checkpointing_func"] = found.original
    return state


def hold_getstate(n: int) -> None:
    """``n`` (1 or -1) more contexts with hooks on a model: torch.nn.Module.__getstate__ is keyinit's while any."""
    with _lock:
        before = _getstate_holders[0]
        _getstate_holders[0] = before + n
        if before == 0 and n > 0:
            torch.nn.Module.__getstate__ = state_without_keyinit
        elif before + n == 0 and torch.nn.Module.__getstate__ is state_without_keyinit:
            torch.nn.Module.__getstate__ = _MODULE_GETSTATE
