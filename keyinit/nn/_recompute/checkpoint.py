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

How keyinit knows a checkpoint is running: its guards (:func:`hold_guards`, on while a keyed
block or a recompute after it has hooks on a model) wrap the first execution of every checkpoint
it knows: ``forward`` of torch's reentrant ``CheckpointFunction`` and of megatron-core's
``CheckpointFunction``/``CheckpointWithoutOutputFunction``, and torch's non-reentrant
checkpoint (its ``_checkpoint_without_reentrant_generator``, whose recompute calls the function
through a :class:`_Later` that keyinit holds). Each pushes a :class:`_Scope` on this thread's
stack for the time the function first runs: where its recompute function is held (handed over as
a :class:`Recompute` by :func:`hand_recomputes`), whether keyinit keys that recompute itself (a
:class:`Region`, transformers' keyed checkpointing), and the frame that was running as it began.
Nothing is found by file or function names.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Optional

import torch

from keyinit.nn._batch.records import annotate, record

__all__ = ["Region", "Recompute", "hand_recomputes", "unseen_recompute", "refuse_unseen", "UNSEEN_RECOMPUTE",
           "hold_guards", "unguarded"]

_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_grad_enabled = torch.is_grad_enabled
_graph_task = torch._C._current_graph_task_id
_fw_grad_enabled = torch._C._is_fwd_grad_enabled
# megatron-core's own activation checkpointing: CheckpointFunction (and CheckpointWithoutOutputFunction) run the
# function in their forward and recompute it in backward, as torch's reentrant checkpoint does
_MEGATRON = "megatron.core.tensor_parallel.random"

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
    saved-tensor hooks set): the innermost checkpoint this thread runs (its guard's :class:`_Scope`) is not one
    whose recompute keyinit keys (:class:`Region`, transformers' wrapper), and no module of the model began
    since it did (the frame running as it began is ``frame``; unset: no hooked module has run inside it yet).
    """
    stack = getattr(_guarded, "stack", None)
    if not stack or (not (frame.forward.grad and not _grad_enabled()) and _saved_tensor_hooks(False) is None):
        return False
    scope = stack[-1]
    return not scope.keyed and (scope.frame is _UNSET or scope.frame is frame)


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
    keyed_recompute = True  # (its recompute is keyed as its first execution: no draw in it is unseen)

    def __init__(self, ctx: Any, frame: Any, function: Any, args: tuple) -> None:
        self.ctx, self.function = ctx, function
        self.forward, self.module, self.fqn = frame.forward, frame.module, frame.fqn
        self.counts = dict(frame.counts)  # the call ordinals taken before the function began
        host = frame.forward.host  # where the forward's host generators stood (None: as seeded)
        self.host = host.state() if host is not None and host.moved() else None
        self.firsts = args
        self.calls = 0
        ctx.mark_recomputable()  # a forward ran under checkpointing: the context's hooks and records stay after
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
            frame = self.ctx.resume_region(self)
            try:
                out = self.function(*inputs, **kwargs)
            except BaseException:
                self.ctx.leave_execution(self.module, inputs, None)
                raise
            if frame is not None:
                self.ctx.leave_execution(self.module, inputs, out)
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


#: :attr:`_Scope.frame` before a module of the model began inside the checkpoint.
_UNSET = object()
_guarded = threading.local()  # .stack: the checkpoints whose first execution runs in this thread, innermost last
#: The contexts a module of whose model ran under checkpointing's conditions with no known checkpoint around it
#: (a hand-written or another library's checkpoint, or only torch.no_grad()/saved-tensor hooks): :func:`unguarded`
_unguarded: "weakref.WeakSet[Any]" = weakref.WeakSet()


class _Scope:
    """One checkpoint's first execution, running in this thread (pushed by keyinit's guard on it): where its
    recompute function is held (``getattr(holder, attr)``), whether keyinit keys its recompute itself, and the
    keyinit frame that was running as it began (:data:`_UNSET` until a hooked module runs inside it)."""

    __slots__ = ("holder", "attr", "keyed", "frame")

    def __init__(self, function: Any, holder: Any, attr: str) -> None:
        self.holder, self.attr = holder, attr
        self.keyed = bool(getattr(function, "keyed_recompute", False))
        self.frame: Any = _UNSET


def _push(function: Any, holder: Any, attr: str) -> _Scope:
    stack = getattr(_guarded, "stack", None)
    if stack is None:
        stack = _guarded.stack = []
    scope = _Scope(function, holder, attr)
    stack.append(scope)
    return scope


def _pop(scope: Optional[_Scope]) -> None:
    stack = getattr(_guarded, "stack", None)
    if scope is None or not stack:
        return
    if stack[-1] is scope:
        stack.pop()
    elif scope in stack:
        stack.remove(scope)


def hand_recomputes(ctx: Any) -> None:
    """A module of ``ctx``'s model runs under activation checkpointing's conditions: hand the recompute function
    of every checkpoint around it (torch's, reentrant or not, and megatron-core's: the :class:`_Scope` s their
    guards pushed in this thread) over as a :class:`Recompute` of ``ctx``. The innermost first; where one is
    handed already, so are those around it. With no checkpoint around it in a forward, ``ctx`` is
    :func:`unguarded`."""
    stack = getattr(_guarded, "stack", None)
    if not stack:
        # a recompute may come of a module run inside an autograd.Function's forward (which turns forward-mode AD
        # off, as torch.no_grad() does not) or under saved-tensor hooks, in a forward (in backward: a recompute)
        if _graph_task() == -1 and (not _fw_grad_enabled() or _saved_tensor_hooks(False) is not None):
            _unguarded.add(ctx)
        return
    frame = _UNSET
    for scope in reversed(stack):
        if scope.frame is _UNSET:  # no module of the model began inside it before: the frame running as it began
            if frame is _UNSET:
                frame = ctx.current_frame()
            scope.frame = frame
        function = getattr(scope.holder, scope.attr, None)
        if isinstance(function, Recompute):
            return
        if function is not None:
            setattr(scope.holder, scope.attr, Recompute(ctx, function))


def unguarded(ctx: Any) -> bool:
    """A module of ``ctx``'s model ran inside an ``autograd.Function``'s forward or under saved-tensor hooks with no
    checkpoint keyinit knows around it: a recompute in backward may come that no checkpoint hands to keyinit
    (keyinit.nn._context.unhanded watches for it). A module run under ``torch.no_grad()`` alone is never recomputed."""
    return ctx in _unguarded


class _Later:
    """The function torch's non-reentrant checkpoint calls to recompute (in place of the checkpointed one, which
    its first execution calls directly): ``function``, a :class:`Recompute` once :func:`hand_recomputes` hands
    it over."""

    __slots__ = ("function",)

    def __init__(self, function: Any) -> None:
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


def _guard_forward(original: Any, holder_at: Optional[int]) -> Any:
    """``forward(ctx, run_function, x, *args)`` of an autograd function that checkpoints ``run_function``
    (torch's reentrant and megatron's), guarded: its first execution runs inside a :class:`_Scope`. The
    recompute function is held at ``ctx.run_function``, or (``holder_at``) at ``run_function`` of the argument
    in that position (megatron's CheckpointWithoutOutput object)."""

    def forward(ctx: Any, run_function: Any, *args: Any) -> Any:
        holder = ctx if holder_at is None else args[holder_at]
        scope = _push(run_function, holder, "run_function")
        try:
            return original(ctx, run_function, *args)
        finally:
            _pop(scope)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return staticmethod(forward)


def _guard_generator(original: Any) -> Any:
    """torch's ``_checkpoint_without_reentrant_generator``, guarded: the checkpointed function's first execution
    (between the generator's two steps, where torch's ``checkpoint`` calls it) runs inside a :class:`_Scope`,
    and its recompute calls it through a :class:`_Later`. Without autograd, torch saves nothing to recompute:
    no scope."""

    def generator(fn: Any, *args: Any, **kwargs: Any) -> Any:
        later = _Later(fn)
        inner = original(later, *args, **kwargs)
        next(inner)
        scope = _push(fn, later, "function") if _grad_enabled() else None
        try:
            yield
        except BaseException as exc:
            _pop(scope)
            try:
                inner.throw(exc)
            except StopIteration:
                return
            raise
        _pop(scope)
        try:
            next(inner)
        except StopIteration:
            return
        yield  # (torch's generator yields twice; a third step is its own error)

    generator.__wrapped__ = original  # type: ignore[attr-defined]
    return generator


_guard_lock = threading.Lock()
_guard_holders = [0]
_guards: list[tuple[Any, str, Any]] = []  # (owner, attribute, what it held before): what hold_guards replaced


def _install_guards() -> None:
    """Guard every checkpoint keyinit knows that is imported and not guarded yet (megatron's may be imported
    while a block holds the guards)."""
    import torch.utils.checkpoint as torch_checkpoint

    done = {(id(owner), name) for owner, name, _ in _guards}
    targets: list[tuple[Any, str, Any]] = []
    function = torch_checkpoint.CheckpointFunction
    targets.append((function, "forward", lambda: _guard_forward(function.forward, None)))
    targets.append((torch_checkpoint, "_checkpoint_without_reentrant_generator",
                    lambda: _guard_generator(torch_checkpoint._checkpoint_without_reentrant_generator)))
    megatron = sys.modules.get(_MEGATRON)
    if megatron is not None:
        for name, at in (("CheckpointFunction", None), ("CheckpointWithoutOutputFunction", 0)):
            owner = getattr(megatron, name, None)
            if owner is not None:
                targets.append((owner, "forward", lambda owner=owner, at=at: _guard_forward(owner.forward, at)))
    for owner, name, make in targets:
        if (id(owner), name) not in done:
            _guards.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, make())


def hold_guards(n: int) -> None:
    """``n`` (1 or -1) more contexts with hooks on a model: keyinit's guards are on the checkpoints it knows
    while any (see the module docstring), and those checkpoints are torch's and megatron's own again after."""
    with _guard_lock:
        before = _guard_holders[0]
        _guard_holders[0] = before + n
        if n > 0:
            _install_guards()
        elif before + n == 0:
            while _guards:
                owner, name, held = _guards.pop()
                setattr(owner, name, held)
