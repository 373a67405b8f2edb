"""Keyed dropout of an activation whose batch is its dimension 0, and the ``nn.Dropout`` modules that take it
without hooks.

:func:`rows_dropout` is what keyed() does for the common dropout call (a plain floating tensor whose
record says its dimension 0 holds samples ``start .. start+count-1``, one row each, outside
checkpointing and tracing, with the context's two modes innermost): the call's key, the op over rows
``start ..``, the output's record. Anything else returns None, and the caller takes the general path
(:func:`keyinit.nn._forward.intercept.handle_dropout`).

:class:`DropoutForward` is the ``forward`` a keyed context gives each ``torch.nn.Dropout`` of its model
(exactly that class, torch's own ``forward``, not in a sequence-first transformer layer) for the
block, in place of the pair of hooks every other module gets: torch then calls the module on its fast
path (no hooks), and the call goes straight to :func:`rows_dropout` instead of through ``F.dropout``,
torch's function handling and the function mode. Where :func:`rows_dropout` does not apply (eval
mode, ``p`` of 0, an activation laid out otherwise, activation checkpointing, a recompute in backward,
another thread, a root forward) it runs the module as the hooks would: the context's pre-hook, torch's
``forward``, the context's post-hook, the same frames and keys. The values are the same either way:
the key is the module's call ordinal in its frame, as if it had one.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any, Callable, Optional

import torch

from keyinit.nn._batch.records import Batch
from keyinit.nn.functional import _op

__all__ = ["DropoutForward", "rows_dropout", "guard_alone", "takes_dropout_forward"]

_FLOATS = frozenset((torch.float32, torch.float64, torch.bfloat16, torch.float16))  # (the kernels' dtypes)

_NoDispatch = torch._C._DisableTorchDispatch
_NoFunctionMode = torch._C.DisableTorchFunction
_grad_enabled = torch.is_grad_enabled
_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_len_dispatch = torch._C._len_torch_dispatch_stack
_dispatch_at = torch._C._get_dispatch_stack_at
_len_function = torch._C._len_torch_function_stack
_function_at = torch._C._get_function_stack_at
_Dropout = torch.nn.Dropout
_DROPOUT_FORWARD = torch.nn.Dropout.forward


def guard_alone(ctx: Any, input: Any) -> bool:
    """``input`` is a plain tensor, nothing is being traced, and this thread's seeded-op guard (the dispatch
    mode of ``ctx``) is the only dispatch mode: what :class:`keyinit.nn._forward.modes.GuardSuspended` does is then
    what ``torch._C._DisableTorchDispatch`` does."""
    if type(input) is not torch.Tensor or not ctx.drawer.eager or _len_dispatch() != 1:
        return False
    state = getattr(ctx.thread_local, "state", None)
    return state is not None and bool(state.modes) and _dispatch_at(0) is state.modes[-1]


def rows_dropout(ctx: Any, forward: Any, foreign: Any, input: Any, p: Any, fqn: str, counts: dict,
                 where: Callable[[], str]) -> Optional[torch.Tensor]:
    """Keyed dropout of ``input`` with drop probability ``p`` by the module ``fqn`` (its next call ordinal
    taken from ``counts``) in root forward ``forward``, where it applies (see the module docstring), else
    None (nothing taken). ``where()`` names the module in an error."""
    if type(input) is not torch.Tensor or type(p) is not float or not 0.0 < p < 1.0 or foreign \
            or ctx.index != "tracked" or not ctx.drawer.eager or input.dtype not in _FLOATS:
        return None
    entry = forward.records.get(id(input))
    if entry is None or entry[0]() is not input:
        return None
    rec = entry[1]
    if type(rec) is not Batch or rec.dim != 0 or rec.inner != 1 or not input.dim() \
            or input.shape[0] != rec.count or (forward.grad and not _grad_enabled()) \
            or _saved_tensor_hooks(False) is not None or not guard_alone(ctx, input):
        return None
    ordinal = counts.get(fqn, 0)
    counts[fqn] = ordinal + 1
    key = forward.call_key(ctx, fqn, ordinal)
    try:
        with _NoDispatch():
            out = _op().call_rows(input, p, key, rec.start)
    except (ValueError, TypeError, RuntimeError) as exc:
        if type(exc) not in (ValueError, TypeError, RuntimeError):
            raise
        raise type(exc)(f"{where()}: dropout under keyinit.nn.keyed: {exc}") from exc
    forward.records[id(out)] = (_ref(out), rec)  # (annotate's own line)
    return out


def _module_call_codes() -> frozenset:
    """The code objects of ``torch.nn.Module._call_impl`` and of its nested ``inner``: the frames that call a
    module's ``forward`` when the module is called (empty where torch is not built this way)."""
    call_impl = getattr(torch.nn.Module._call_impl, "__code__", None)
    if call_impl is None:
        return frozenset()
    inner = [c for c in call_impl.co_consts if isinstance(c, types.CodeType) and c.co_name == "inner"]
    return frozenset((call_impl, *inner)) if len(inner) == 1 else frozenset()


_CALLED = _module_call_codes()


def takes_dropout_forward(module: torch.nn.Module) -> bool:
    """``module`` is exactly ``torch.nn.Dropout`` with torch's ``forward`` (none set on the instance), and this
    torch calls a module's ``forward`` from the frames :class:`DropoutForward` knows."""
    return type(module) is _Dropout and _Dropout.forward is _DROPOUT_FORWARD and "forward" not in module.__dict__ \
        and len(_CALLED) == 2


class DropoutForward:
    """The ``forward`` of the ``nn.Dropout`` module ``module`` (FQN ``fqn``) of the keyed context ``ctx``'s
    model during the block (see the module docstring); :meth:`remove` gives the module back its own.

    ``pre_hook`` and ``post_hook`` are the context's hooks for the module, run around torch's forward
    where :func:`rows_dropout` does not apply.
    """

    __slots__ = ("ctx", "module", "fqn", "pre_hook", "post_hook", "forward_calls")

    def __init__(self, ctx: Any, module: torch.nn.Module, fqn: str, pre_hook: Callable, post_hook: Callable) -> None:
        self.ctx, self.module, self.fqn = ctx, module, fqn
        self.pre_hook, self.post_hook = pre_hook, post_hook
        self.forward_calls = ctx.calls == "forward"
        module.__dict__["forward"] = self

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self:
            del self.module.__dict__["forward"]

    def __reduce_ex__(self, protocol: Any) -> tuple:
        # a copy of the module made during the block (copy.deepcopy, pickle) is not part of the keyed model: it
        # gets torch's forward of its own copy, not this context
        return getattr, (self.module, "forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if sys._getframe(1).f_code not in _CALLED:
            # module.forward(x) called directly, not the module: no hooks would run, so the module has no frame
            return _DROPOUT_FORWARD(module, *args, **kwargs)
        if len(args) == 1 and not kwargs and module.training and not module.inplace:
            state = getattr(self.ctx.thread_local, "state", None)
            if state is not None and state.frames:
                # the pre-hook's common case: inside a running forward, no checkpointing, the two modes innermost
                parent = state.frames[-1]
                forward, modes = parent.forward, state.modes
                if (_grad_enabled() or not forward.grad) and _saved_tensor_hooks(False) is None \
                        and _len_function() == 1 and _function_at(0) is modes[0] \
                        and _len_dispatch() and _dispatch_at(_len_dispatch() - 1) is modes[1]:
                    # the module's frame would take its ordinal from the forward's counts (calls="forward"),
                    # or from its own, new at each execution (calls="execution"). The function mode (the only
                    # one) is off while keyinit's ops run, as it is inside its own handlers
                    with _NoFunctionMode():
                        out = rows_dropout(self.ctx, forward, parent.foreign, args[0], module.p, self.fqn,
                                           parent.counts if self.forward_calls else {}, self._where)
                    if out is not None:
                        return out
        output = None
        try:  # (as torch calls the hooks: the post-hook also where the pre-hook or the forward raised)
            self.pre_hook(module, args, kwargs)
            output = _DROPOUT_FORWARD(module, *args, **kwargs)
        finally:
            self.post_hook(module, args, output)
        return output

    def _where(self) -> str:
        return f"module '{self.fqn}' (Dropout)" if self.fqn else "the root module (Dropout)"


_ref = weakref.ref
