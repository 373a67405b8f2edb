"""``keyed(model, seed, step=..., sample_offset=...)``: every random op in ``model``'s forward, keyed.

The context: module hooks that open a frame per module execution (its FQN and
call counter), the root forwards (:class:`Forward`: the rows a forward holds,
its repeat count, its tensors' batch records), the two modes entered by the
outermost forward (:mod:`keyinit.nn._forward.modes`), micro-batches, named blocks, and
the recomputes of activation checkpointing, found again in backward.

When the block ends, the model is as it was (no hook, no attribute of keyinit's:
``torch.save(model)``, ``pickle`` and ``copy.deepcopy`` work; a copy made inside
the block carries none of them either). A recompute that checkpointing runs in a
later ``backward()`` still gets its first execution's keys: the checkpoint holds
its function as a :class:`keyinit.nn._recompute.checkpoint.Recompute` of the context (handed
over at the first execution), whose call puts the context's hooks back on the
model for that call only (:meth:`Keyed.recomputing`). Another ``keyed()`` entered
before that ``backward()`` changes none of its keys.

A forward of the model in a thread other than the one that entered the context
gets its own frames and modes, and refuses every draw there
(:class:`~keyinit.errors.UnkeyedRandomnessError` naming the thread), except a
recompute of one of its forwards (autograd's worker thread on CUDA). A
``keyed`` on a submodule entered inside a ``keyed`` on its model with the same
values keys nothing more (the outer context keys the submodule by its FQN
there); any other overlap of two active contexts is a ``RuntimeError``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Any, Callable, Optional, Union

import torch

from keyinit.fqn import canonical_modules
from keyinit._bits.streams import get_stream
from keyinit._draw.names import DEFAULT_FORWARD_STREAM
from keyinit.keys import Key, as_uint64, key
from keyinit.nn._batch.records import Batch, annotate, declared
from keyinit.nn._batch.functorch import root_inputs
from keyinit.nn._forward.intercept import Frame
from keyinit.nn._forward.pieces import (
    CheckpointingFunction,
    Forward,
    input_tensors,
    pure_leaf,
    Named,
    resolve_sample_offset,
    sequence_first_dropouts,
    sequence_first_module,
    recomputed,
    recompute_counts,
    remember,
    remember_counts,
    remember_host,
    CALLS_RULES,
)
from keyinit.nn._forward.hostrandom import HOST_RANDOM
from keyinit.nn._forward.dropout import DropoutForward, takes_dropout_forward
from keyinit.nn._recompute.checkpoint import hand_recomputes, hold_guards, unguarded
from keyinit.nn._context.unhanded import watch
from keyinit.nn._context.copies import hold_getstate
from keyinit.nn._context.fullgraph import refuse_full_graph, warn_if_compiled
from keyinit.nn._context.unwrapped import hold_chunk_marks, refuse_unwrapped_chunk, surface_chunk_error
from keyinit.nn._context.frames import (FrameStack, MicroBatch, UNMATCHED_RECOMPUTE, later_block, _ThreadState,
                                      _grad_enabled, _saved_tensor_hooks, _saved_tensor_hooks_active,
                                      _top_dispatch_mode, _top_function_mode)

__all__ = ["Keyed", "inside_keyed_forward", "current_forward", "running_frame", "context_of"]

INDEX_RULES = ("tracked", "dim0")

_state = threading.local()  # .active: list of Keyed entered in this thread, innermost last
_entered_lock = threading.Lock()
_entered: list = []  # every Keyed entered and not yet exited, in any thread
_recomputes = threading.local()  # .stack: contexts whose recompute runs in this thread, innermost last
# contexts left with recomputes that may come (the autograd graph of their forwards' tensors holds them, see
# Keyed._hold_in_graph): a module of their model run in backward by a checkpoint keyinit was not handed is
# refused by a later block, not keyed as its own forward
_left: "weakref.WeakSet[Keyed]" = weakref.WeakSet()


def _alive(ctx: "Keyed") -> bool:
    return any(ref() is not None for f in ctx._forwards for ref, _ in f.records.values())


def _recomputing() -> Optional["Keyed"]:
    """The context whose recompute runs innermost in this thread, or None."""
    stack = getattr(_recomputes, "stack", None)
    return stack[-1] if stack else None


def _active() -> list:
    active = getattr(_state, "active", None)
    if active is None:
        active = []
        _state.active = active
    return active


def inside_keyed_forward() -> bool:
    """True when this thread runs the forward of a module of a model inside an active ``keyed``.

    Also in a thread other than the one that entered the context: there, a draw is refused.
    """
    with _entered_lock:
        contexts = list(_entered)
    return any(ctx.current_frame() is not None for ctx in contexts)


# ----------------------------------------------------------------------------- the context


def context_of(module: torch.nn.Module) -> Optional["Keyed"]:
    """The innermost context entered in this thread whose model is or holds ``module``, or None."""
    for ctx in reversed(_active()):
        if ctx._covered_by is None and ctx.module_fqn(module) is not None:
            return ctx
    return None


def running_frame() -> Optional[tuple["Keyed", Frame]]:
    """``(context, frame)`` of the module forward running in this thread inside an active ``keyed``, or None."""
    for ctx in reversed(_active()):
        frame = ctx.current_frame()
        if frame is not None:
            return ctx, frame
    return None


def current_forward() -> Optional[Forward]:
    """The root forward running in this thread inside an active ``keyed``, or None."""
    for ctx in reversed(_active()):
        frame = ctx.current_frame()
        if frame is not None:
            return frame.forward
    return None


def _module_fqn(root: torch.nn.Module, module: torch.nn.Module) -> Optional[str]:
    """The canonical FQN of ``module`` inside ``root`` (the first path), or None."""
    for _, fqn, candidate in canonical_modules(root):
        if candidate is module:
            return fqn
    return None


class Keyed(FrameStack):
    """The context manager :func:`keyed` returns (single use; enter it with ``with``)."""

    def __init__(self, model: Union[torch.nn.Module, str], seed: Union[int, Key], step: int,
                 sample_offset: Optional[int], index: str = "tracked", inputs: Any = (),
                 host_random: str = "sample", calls: Optional[str] = None,
                 stream: Optional[str] = None) -> None:
        self._inputs: tuple = ()
        if isinstance(model, str):
            from keyinit.nn._ops.keys import check_fqn

            if model == "":
                raise ValueError("keyed: a named block needs a non-empty name (dot-separated, like an FQN)")
            check_fqn(model)
            self._inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
            if not all(isinstance(t, torch.Tensor) for t in self._inputs):
                raise TypeError("keyed: inputs must be tensors (the block's batch-holding tensors)")
            model = Named(model)
        elif inputs != ():
            raise TypeError("keyed: inputs= is for a named block (keyed('name', ...)); a model's inputs are its "
                            "forward's arguments")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"keyed: model must be a torch.nn.Module or a block name, got {type(model).__name__}")
        if index not in INDEX_RULES:
            raise ValueError(f"keyed: index must be one of {INDEX_RULES}, got {index!r}")
        if host_random not in HOST_RANDOM:
            raise ValueError(f"keyed: host_random must be one of {HOST_RANDOM}, got {host_random!r}")
        if calls is None:
            calls = "execution" if index == "dim0" else "forward"  # index="dim0" is stream v1's first rule, whole
        if calls not in CALLS_RULES:
            raise ValueError(f"keyed: calls must be one of {CALLS_RULES}, got {calls!r}")
        self.index = index
        #: How call ordinals are numbered (docs/spec.md 14.4): "forward" on across a module's executions in a
        #: root forward, "execution" from 0 at each (v1's first rule: executions of a module share keys).
        self.calls = calls
        self.host_mode = host_random  # keyed(..., host_random=): see keyinit.nn._forward.hostrandom
        self.model = model
        #: The root of every dropout key (:func:`keyinit.nn.dropout_key`'s ``seed``); ``key`` checks an int.
        root = seed if isinstance(seed, Key) else key(seed)
        stream = DEFAULT_FORWARD_STREAM if stream is None else stream  # (a Key seed's own stream: its root only)
        get_stream(stream)  # an unknown version says so
        root = Key(root.k0, root.k1, stream)  # (the derivation of sections 1-3 is the same in v1 and v2)
        self.root = root
        self.seed = seed  # as given, for the repr
        self.step = as_uint64(step, "step")
        self.sample_offset = resolve_sample_offset(model, sample_offset)
        self._handles: list[Any] = []
        self._hooked: dict[int, tuple[torch.nn.Module, str, list]] = {}  # id(module) -> (module, fqn, handles)
        self._names: dict[int, tuple[torch.nn.Module, str]] = {}  # id(module) -> (module, canonical FQN)
        self._thread: Optional[int] = None
        self._local = threading.local()
        self._owner: Optional[_ThreadState] = None
        self._covered_by: Optional["Keyed"] = None  # an outer context that keys this model already
        self.sequence_first: frozenset[int] = frozenset()  # see _sequence_first_dropouts
        self._sequence_first_modules: set[int] = set()  # ids of its sequence-first torch layers (_pre_hook)
        self._state = "new"
        self._rows = 0  # the running micro-batch's first sample, relative to sample_offset (micro_batch)
        self.probing = False  # root forwards now are shape probes (keyinit.nn.micro_batches between chunks)
        self._history: dict[str, list[tuple[int, int]]] = {}  # root module FQN -> rows of its root forwards
        self._replays: dict[tuple, tuple[Any, "Forward"]] = {}  # see _remember
        self._forwards: list[Forward] = []  # the root forwards of the block (for recomputes in backward)
        self.constants: frozenset[int] = frozenset()  # ids of the model's buffers (set on __enter__)
        self._shared_post_hook: Optional[Callable] = None  # see _hook
        # a forward ran under activation checkpointing (autograd off inside, or saved-tensor hooks): only
        # then may a recompute come after the block, and only then are its forwards' records kept (__exit__)
        self._recomputable = False
        self._plan: list[tuple[torch.nn.Module, str, bool]] = []  # (module, fqn, light): the hooks a recompute
        self._installs = 0  # recomputes running with the hooks put back after the block (recomputing)
        self._holds_getstate = False  # counted in hold_getstate

    def __repr__(self) -> str:
        return (f"keyed({type(self.model).__name__}, seed={self.seed}, step={self.step}, "
                f"sample_offset={self.sample_offset})")

    def _root_forward(self, module: torch.nn.Module, fqn: str, args: tuple, kwargs: dict) -> "Forward":
        """A new root forward: its rows, its repeat count, and its inputs' batch records."""
        start = self.sample_offset + self._rows
        tensors, vmapped = root_inputs(input_tensors(args, kwargs))  # (torch.func.vmap: its physical tensors)
        default_dim = 1 if sequence_first_module(module) else 0
        count = None
        dims: list[Optional[int]] = []
        for t, vdim in zip(tensors, vmapped):
            mark = declared(t)
            dim = vdim if vdim is not None else mark[1] if mark is not None else (
                default_dim if t.dim() > default_dim else None)
            dims.append(dim)
            if count is None and dim is not None:
                count = int(t.shape[dim])
        count = count or 0
        self._check_sample_rows(fqn, count, tensors, dims)
        rows = self._history.get(fqn, [])
        repeat = sum(1 for a, b in rows if a < start + count and start < b) if count else len(rows)
        forward = Forward(self, fqn, start, count, repeat)
        forward.probe = self.probing or any(t.device.type == "meta" for t in tensors)
        if repeat and not forward.probe:
            refuse_unwrapped_chunk(module, fqn, count)  # a pipelining schedule's chunk without micro_batches
        self._forwards.append(forward)
        if self.index == "tracked":
            for t, dim in zip(tensors, dims):
                explicit = declared(t) is not None
                if dim is not None and (explicit or int(t.shape[dim]) == count):
                    annotate(t, forward, Batch(dim, int(t.shape[dim]), start))
        return forward

    def _pre_hook(self, fqn: str, light: bool = False) -> Callable:
        """The forward pre-hook of the module ``fqn``: a frame for its execution (see the module docstring).
        ``light``: one of torch.nn's layers that draw nothing (:func:`keyinit.nn._forward.pieces.pure_leaf`), whose
        execution inside a running forward needs no frame of its own; it gets one only where a recompute may
        have to be found again (under activation checkpointing, in backward) or it is a root forward."""
        local, forward_calls, sequence_first = self._local, self.calls == "forward", self._sequence_first_modules

        def hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            state = getattr(local, "state", None)
            if state is not None and state.frames:
                # the common case: a module inside a running forward, no checkpointing, the two modes innermost
                parent = state.frames[-1]
                forward = parent.forward
                modes = state.modes
                if (_grad_enabled() or not forward.grad) and _saved_tensor_hooks(False) is None \
                        and id(module) not in sequence_first and _top_function_mode() is modes[0] \
                        and _top_dispatch_mode() is modes[1]:
                    if not light:
                        state.frames.append(Frame(module, fqn, parent.foreign, forward,
                                                  parent.counts if forward_calls else {}))
                    return
            scope = _recomputing()
            if scope is not None and scope is not self:
                return  # the recompute of another context's forward runs here: its hooks key it
            state = self.thread_state()
            foreign = state.foreign
            if state.frames:
                parent = state.frames[-1]
                forward = parent.forward
                foreign = parent.foreign  # a recompute's children are keyed as it is
                counts = parent.counts if self.calls == "forward" else {}
                checkpointed = True
                if forward.grad and not torch.is_grad_enabled():  # reentrant checkpointing
                    remember(self, fqn, forward, args, kwargs)
                elif _saved_tensor_hooks_active():  # non-reentrant checkpointing may start here
                    if forward.host is not None:
                        remember_host(fqn, forward, args, kwargs)
                else:
                    checkpointed = False
                if checkpointed:
                    self._recomputable = True
                    hand_recomputes(self)
                    if self.calls == "forward":
                        remember_counts(fqn, forward, counts, args, kwargs)
            else:
                in_backward = torch._C._current_graph_task_id() != -1
                forward = recomputed(self, fqn, args, kwargs) if in_backward else None
                if forward is not None:
                    foreign = False  # a recompute runs in autograd's thread, with the first execution's keys
                    counts = recompute_counts(self, forward, fqn, args, kwargs) if self.calls == "forward" else {}
                elif in_backward and (self._recomputable or self._earlier(module) is not None):
                    # a module run in backward, after forwards under activation checkpointing, that no forward's
                    # execution matches: a recompute whose inputs were made anew outside the model's modules, or
                    # one of an earlier block's forward that its checkpoint did not hand over. Its draws are
                    # refused (never keyed as a new forward, never left to torch's generator)
                    earlier = self._earlier(module)
                    why = UNMATCHED_RECOMPUTE if earlier is None else later_block(self, earlier)
                    forward, counts, foreign = self._unmatched(fqn), {}, why
                elif self._state != "entered":
                    return  # left: only recomputes of its own forwards are keyed
                else:
                    forward = self._root_forward(module, fqn, args, kwargs)
                    counts = forward.counts
                    warn_if_compiled()
                    if not torch.is_grad_enabled():
                        remember(self, fqn, forward, args, kwargs)
                        self._recomputable = True
                        hand_recomputes(self)
                    elif _saved_tensor_hooks_active():
                        hand_recomputes(self)
            if not self._recomputable and _saved_tensor_hooks_active():
                self._recomputable = True  # non-reentrant checkpointing (saved-tensor hooks) may recompute this
            frame = Frame(module, fqn, foreign, forward, counts)
            host = None
            if not state.frames and not foreign:
                host = forward.host_random(self, fqn, args, kwargs)
            elif not state.frames and isinstance(foreign, str):  # (its host draws are refused too)
                host = self._refusing_host(frame, foreign)
            self._open(state, frame, host)
            if self.index == "tracked" and len(state.frames) > 1 and id(module) in self._sequence_first_modules:
                try:
                    self._check_sequence_first(module, frame, args, kwargs)
                except BaseException:
                    self._post_hook()(module, args, None)
                    raise

        hook._keyinit_hook = True  # type: ignore[attr-defined]  # (left out of a copy: keyinit.nn._context.copies)
        return hook

    def _post_hook(self) -> Callable:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            state = getattr(self._local, "state", None)
            if state is None:
                return
            frames = state.frames
            if frames and frames[-1].module is module and not frames[-1].pushed:
                frames.pop()  # (the common case of the loop below: this module's frame, no mode to leave)
                return
            if not any(frame.module is module for frame in frames):
                return  # a forward this context did not key (after the context was left)
            refusal = None
            while frames:  # robust to a forward that raised inside a child
                frame = frames.pop()
                for mode in reversed(frame.pushed):
                    mode.__exit__(None, None, None)
                    refusal = getattr(mode, "refusal", None) or refusal  # a host draw refused (_forward/hostrandom.py)
                if frame.module is module:
                    break
            if refusal is not None and sys.exc_info()[0] is None:
                raise refusal  # before the forward's output reaches the caller

        hook._keyinit_hook = True  # type: ignore[attr-defined]
        return hook

    def _earlier(self, module: torch.nn.Module) -> Optional["Keyed"]:
        """A context left before this one was entered, whose model holds ``module`` and whose recomputes may
        still come, or None."""
        with _entered_lock:
            left = list(_left)
        for old in left:
            if old is not self and _alive(old) and old.module_fqn(module) is not None:
                return old
        return None

    def _check_nesting(self) -> bool:
        """False to key nothing here (an outer context keys the model already); raises on a conflict."""
        for outer in _active():
            if outer.model is self.model:
                raise RuntimeError(
                    f"keyed: {type(self.model).__name__} is already inside a keyinit.nn.keyed context (nested "
                    "keyed() on the same model)"
                )
            fqn = _module_fqn(outer.model, self.model)
            if fqn is not None:
                same = (outer.root, outer.step, outer.sample_offset) == (self.root, self.step, self.sample_offset)
                if not same:
                    raise RuntimeError(
                        f"keyed: {self!r} entered inside {outer!r}, where this module is '{fqn}': its dropout is "
                        f"keyed by the outer context with the FQN '{fqn}' and the outer seed/step/sample_offset; "
                        "a nested keyed() with other values would make its masks ambiguous. Remove the inner "
                        "keyed() (or give it the outer values: it then keys nothing more)."
                    )
                self._covered_by = outer
                return False
            if _module_fqn(self.model, outer.model) is not None:
                raise RuntimeError(
                    f"keyed: {self!r} entered inside {outer!r}, whose model is one of this model's submodules: "
                    "enter keyinit.nn.keyed once, on the whole model"
                )
        return True

    def __enter__(self) -> "Keyed":
        if self._state != "new":
            raise RuntimeError("a keyinit.nn.keyed context can be entered once; call keyed(...) again")
        self._state = "entered"
        if not self._check_nesting():
            return self  # keyed by the outer context, with this module's FQN there
        self._thread = threading.get_ident()
        self._owner = self.thread_state()
        self._holds_getstate = True  # (and keyinit's guards on checkpoints: named blocks too)
        hold_getstate(1)
        hold_guards(1)
        hold_chunk_marks(1)
        if isinstance(self.model, Named):  # one root forward for the whole block, its inputs as given
            _active().append(self)
            with _entered_lock:
                _entered.append(self)
            try:
                self._pre_hook(self.model.name)(self.model, self._inputs, {})
            except BaseException:
                self._teardown()
                raise
            return self
        buffers: set[int] = set()
        in_sequential: set[int] = set()  # children of an nn.Sequential (torch's checkpoint_sequential cuts them)
        dropouts: list[tuple[torch.nn.Module, str]] = []
        try:
            for raw, fqn, module in canonical_modules(self.model):
                if id(module) in self._names:
                    continue
                self._names[id(module)] = (module, fqn)
                if module._buffers:
                    buffers.update(id(b) for b in module._buffers.values() if b is not None)
                if isinstance(module, torch.nn.Sequential):
                    in_sequential.update(id(child) for child in module._modules.values())
                if getattr(type(module), "keys_its_calls", False):  # keyinit.nn.KeyedCompiled: no hooks for dynamo to see
                    # (its modules are hooked as any other, so a direct call of one is keyed; its call takes their
                    # hooks off while its compiled code runs: CompiledCalls.suspend)
                    continue
                if module is not self.model and pure_leaf(module):
                    # draws nothing: no frame of its own inside a forward. No hooks at all, except in an
                    # nn.Sequential, where a recompute by torch's checkpoint_sequential may begin with it and
                    # must be found again (light hooks: a frame only under checkpointing or in backward)
                    if id(module) in in_sequential:
                        self._hook(module, fqn, light=True)
                        self._plan.append((module, fqn, True))
                    continue
                if module is not self.model and self.index == "tracked" and takes_dropout_forward(module):
                    dropouts.append((module, fqn))  # (unless in a sequence-first layer: below)
                    continue
                self._hook(module, fqn)
                self._plan.append((module, fqn, False))
                if callable(module.__dict__.get("_gradient_checkpointing_func")):  # transformers' checkpointing
                    self._handles.append(CheckpointingFunction(self, module))
            self.constants = frozenset(buffers)  # the model's buffers: replicated unless computed otherwise
            self.sequence_first = sequence_first_dropouts(module for module, _ in self._names.values())
            for module, fqn in dropouts:  # nn.Dropout: a forward of its own for the block instead of hooks
                self._plan.append((module, fqn, False))  # (a recompute after the block: hooks, the same keys)
                if id(module) in self.sequence_first:
                    self._hook(module, fqn)
                else:
                    handle = DropoutForward(self, module, fqn, self._pre_hook(fqn), self._post_hook_of())
                    self._hooked[id(module)] = (module, fqn, [handle])
                    self._handles.append(handle)
            _active().append(self)
            with _entered_lock:
                _entered.append(self)
        except BaseException:
            self._teardown()
            self._state = "exited"
            raise
        return self

    def _post_hook_of(self) -> Callable:
        if self._shared_post_hook is None:
            self._shared_post_hook = self._post_hook()  # (one for every module: it takes the module)
        return self._shared_post_hook

    def _hook(self, module: torch.nn.Module, fqn: str, light: bool = False) -> None:
        handles = [module.register_forward_pre_hook(self._pre_hook(fqn, light), with_kwargs=True),
                   module.register_forward_hook(self._post_hook_of(), always_call=True)]
        self._handles.extend(handles)
        self._hooked[id(module)] = (module, fqn, handles)
        if sequence_first_module(module):
            self._sequence_first_modules.add(id(module))

    def micro_batch(self, offset: int) -> "MicroBatch":
        """Context manager: root forwards inside hold the rows from ``sample_offset + offset`` on.

        For several forwards of one keyed block over different rows of the step's batch
        (gradient accumulation, pipeline micro-batches): each micro-batch's first sample
        is ``offset`` rows after this context's ``sample_offset``. Its masks are then the
        ones the whole batch's forward draws for those rows.
        """
        return MicroBatch(self, as_uint64(offset, "offset"))

    def _forget(self) -> None:
        if self in _active():
            _active().remove(self)
        with _entered_lock:
            if self in _entered:
                _entered.remove(self)

    def _unhook(self) -> None:
        """Take this context's hooks (and nn.Dropout forwards, transformers' wrapped checkpointing functions)
        off the model, and drop the references that run back to the context from this thread's state (its
        modes hold it), so that the block's objects are freed when nothing else holds them."""
        self._leave_frames()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooked = {}
        if self._holds_getstate:
            self._holds_getstate = False
            hold_getstate(-1)
            hold_guards(-1)
            hold_chunk_marks(-1)
        vars(self._local).clear()  # (this thread's state: its modes hold the context)
        self._shared_post_hook, self._owner, self._local = None, None, threading.local()

    def _teardown(self) -> None:
        self._unhook()
        self._names = {}
        self._plan = []
        self._forget()
        self._forwards, self._replays = [], {}
        _left.discard(self)
        self._state = "exited"

    @contextlib.contextmanager
    def recomputing(self) -> Any:
        """Context manager around a recompute of one of this context's forwards (see
        :class:`keyinit.nn._recompute.checkpoint.Recompute`): in this thread, the hooks of every other context stand
        aside; after the block, this context's hooks are on the model while it runs (and only then)."""
        stack = getattr(_recomputes, "stack", None)
        if stack is None:
            stack = _recomputes.stack = []
        installed = False
        if self._state != "entered":
            with _entered_lock:
                self._installs += 1
                installed = self._installs == 1
            if installed:
                for module, fqn, light in self._plan:
                    self._hook(module, fqn, light)
                self._holds_getstate = True
                hold_getstate(1)
                hold_guards(1)
                hold_chunk_marks(1)
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()
            if self._state != "entered":
                with _entered_lock:
                    self._installs -= 1
                    last = self._installs == 0
                if last:
                    self._unhook()

    def __exit__(self, *exc_info: Any) -> None:
        if isinstance(self.model, Named):
            try:
                self._post_hook()(self.model, (), None)  # raises a refused host draw (after leaving the block)
            except BaseException:
                self._teardown()
                raise
        if exc_info[0] is None and self._recomputable and self._covered_by is None:
            # A forward ran under activation checkpointing: a recompute may come in a backward() after the
            # block. The model is left as it was; the records of its forwards stay with this context, which
            # the checkpoints hold (hand_recomputes, Region, CheckpointingFunction): freed with the graph.
            self._unhook()
            self._forget()
            self._state = "left"
            self._hold_in_graph()
            _left.add(self)
            return
        self._teardown()
        if exc_info[1] is not None:
            refuse_full_graph(exc_info[1])  # dynamo's error on tracing keyinit's hooks (fullgraph=True)
            surface_chunk_error(exc_info[1])  # an unwrapped pipeline chunk's refusal, under the stage's error

    def _hold_in_graph(self) -> None:
        """The autograd nodes of its forwards' tensors still alive hold this context (in their metadata): it
        lives while a backward() may recompute its forwards, as long as the graph, and no longer."""
        for forward in self._forwards:
            for ref, _ in forward.records.values():
                t = ref()
                node = t.grad_fn if t is not None else None
                if node is not None:
                    held = node.metadata.setdefault("keyinit_keyed_contexts", [])
                    if not any(ctx is self for ctx in held):
                        held.append(self)
        if unguarded(self):  # a recompute that no checkpoint hands to keyinit may come: keyinit.nn._context.unhanded
            watch(self)
