"""The frame stack of a keyed context: each thread's frames and modes, and the frames opened for recomputes.

:class:`FrameStack` is :class:`keyinit.nn._context.keyed.Keyed`'s base: where a module
execution's :class:`~keyinit.nn._forward.intercept.Frame` is pushed (with the host
generators' context and the modes it enters), the frame of a
``keyinit.nn.checkpoint`` region's recompute (:mod:`keyinit.nn._recompute.checkpoint`), the
refusing frame of a module run in backward that no forward's execution matches,
the frame of a recompute that no checkpoint handed to keyinit (:mod:`keyinit.nn._context.unhanded`),
the check of torch's sequence-first layers, and :class:`MicroBatch` (``ctx.micro_batch(offset)``: the rows
its root forwards hold).
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from keyinit.nn._batch.records import Batch, record
from keyinit.nn._forward.drawer import EAGER
from keyinit.nn._forward.pieces import Forward, input_tensors, recomputed
from keyinit.nn._forward.hostrandom import HostRandom
from keyinit.nn._forward.intercept import Frame
from keyinit.nn._context.calls import CompiledCalls
from keyinit.nn._forward.modes import BatchMode, FunctionMode, mode_is_active

__all__ = ["FrameStack", "MicroBatch", "UNMATCHED_RECOMPUTE", "later_block"]

#: Why every draw of a module run in backward that no forward's execution matches is refused (see _pre_hook).
UNMATCHED_RECOMPUTE = (
    "in backward: activation checkpointing recomputes this module, but keyinit cannot match the recompute to the "
    "execution it repeats (its inputs were computed anew in the recompute, outside the model's modules: "
    "torch.utils.checkpoint of a function that computes, or calls one of torch.nn's layers that draw nothing "
    "such as Linear, before it calls this module), so it cannot give it that "
    "execution's keys. Checkpoint a module (checkpoint(module, x), checkpoint_wrapper(module)) or checkpoint the "
    "function with keyinit.nn.checkpoint, whose recompute is keyed as its first execution"
)


def later_block(later: Any, earlier: Any) -> str:
    """Why every draw of a module run in backward inside ``later`` (a keyed context) is refused when no forward
    of ``later`` matches it and ``earlier``, a block left before ``later`` was entered, may have a recompute
    of it pending that its checkpoint did not hand to keyinit."""
    return (
        f"in backward inside {later!r}, which was entered after {earlier!r} and before that block's "
        "backward(): activation checkpointing recomputes this module, but its checkpoint did not hand the "
        "recompute to keyinit (not torch.utils.checkpoint, transformers' gradient checkpointing, megatron's "
        f"tensor_parallel.checkpoint or keyinit.nn.checkpoint), so keyinit cannot tell whether it repeats an "
        f"execution of {earlier!r} or of {later!r}, and cannot give it that execution's keys. Run the earlier "
        f"block's backward() before entering {later!r}, or checkpoint with one of those"
    )


class _ThreadState:
    """One thread's forwards of a keyed model: its frame stack and its own mode objects."""

    __slots__ = ("frames", "modes", "foreign", "pending")

    def __init__(self, ctx: Any, foreign: bool) -> None:  # (ctx: the keyinit.nn._context.keyed.Keyed context)
        self.frames: list[Frame] = []
        self.modes: list[Any] = [FunctionMode(ctx), BatchMode(ctx)]
        self.foreign = foreign
        self.pending: Any = None  # the batch of the factory the function mode is running


_grad_enabled = torch.is_grad_enabled
_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def _top_function_mode() -> Any:
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n else None


def _top_dispatch_mode() -> Any:
    n = torch._C._len_torch_dispatch_stack()
    return torch._C._get_dispatch_stack_at(n - 1) if n else None


def _saved_tensor_hooks_active() -> bool:
    """Saved-tensor hooks are set (``checkpoint(use_reentrant=False)`` sets them around its forward)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None



class FrameStack(CompiledCalls):
    """The frames of a keyed context (see the module docstring); the context's state is
    :class:`keyinit.nn._context.keyed.Keyed`'s."""

    #: keyed(samples=batch): the batch's rows (its SamplePositions), which each root forward must hold
    sample_rows: Optional[int] = None
    drawer = EAGER  # what its draws become (keyinit.nn._forward.drawer): computed now
    _micro = 0  # micro_batch() blocks open (their root forwards hold part of the rows)

    def _check_sample_rows(self, fqn: str, count: int, tensors: Any, dims: list) -> None:
        """A root forward of a block keyed with ``samples=`` holds that batch's rows (in a ``micro_batch``,
        some of them): anything else (a batch flattened or packed to one row, a batch cut without
        ``micro_batch``) would key other samples' rows, silently."""
        rows = self.sample_rows
        if rows is None or not count or self.probing or (self._micro and self._rows + count <= rows):
            return
        if count == rows and not self._micro:
            return
        where = next((f"dimension {d} of a tensor of shape {tuple(t.shape)}" for t, d in zip(tensors, dims)
                      if d is not None), "its inputs")
        raise ValueError(
            f"keyed: samples= is a batch of {rows} rows (its SamplePositions), but the forward of "
            f"{fqn or type(self.model).__name__!r} holds {count} rows ({where}"
            f"{f', from row {self._rows} in a micro_batch' if self._micro else ''}): each row of a keyed forward is "
            "one sample of that batch. A batch flattened or packed into fewer rows (DataCollatorWithFlattening, "
            "cu_seqlens) names its samples by row and cannot be keyed per sample: key it with sample_offset= "
            "(its rows as the samples) or keep one sample per row; rows cut from the batch go in "
            "ctx.micro_batch(offset)")

    @property
    def thread_local(self) -> threading.local:
        """Where each thread's state is (``thread_local.state``: its frames and modes; absent in a thread that
        has run nothing of this context): what the modes read without creating one."""
        return self._local

    def thread_state(self) -> _ThreadState:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ThreadState(self, foreign=threading.get_ident() != self._thread)
        return state

    def drew_rows(self, fqn: str, start: int, stop: int) -> None:
        """A root forward of ``fqn`` over rows ``start .. stop - 1`` drew keyed values: a later forward of
        those rows is a repeat."""
        self._history.setdefault(fqn, []).append((start, stop))

    def current_frame(self) -> Optional[Frame]:
        state = getattr(self._local, "state", None)
        if state is not None and state.frames:
            return state.frames[-1]
        return None

    def resume_region(self, region: Any) -> Frame:
        """The recompute of a ``keyinit.nn.checkpoint`` region (:class:`keyinit.nn._recompute.checkpoint.Region`):
        a frame of the module that called it, in its forward, with the call ordinals, host generator states (where
        no frame is open) and modes it began with; left by the post-hook of that module. After the context was
        over (also after the block, and after another ``keyed()`` began: the region holds the context)."""
        state = self.thread_state()
        forward = region.forward
        frame = Frame(region.module, region.fqn, False, forward, dict(region.counts))
        host = None
        if not state.frames:
            host = forward.host_random(self, region.fqn, resumed=(region.host,))
        self._open(state, frame, host)
        return frame

    # What the recompute code (keyinit.nn._recompute, keyinit.nn._forward.pieces) asks of the context.

    def mark_recomputable(self) -> None:
        """A forward ran under activation checkpointing: the context's hooks and records stay after the block
        while its tensors live (:meth:`keyinit.nn._context.keyed.Keyed.__exit__`)."""
        self._recomputable = True

    @property
    def forwards(self) -> list:
        """The root forwards of the block, oldest first (where a recompute in backward finds its own); not to
        be changed by the reader."""
        return self._forwards  # type: ignore[attr-defined]

    def remember_replay(self, replay: tuple, tensor: torch.Tensor, forward: Forward) -> None:
        """Input ``tensor`` of a module run with autograd off in ``forward`` (reentrant checkpointing), found
        again by ``replay`` (its module and memory: :func:`keyinit.nn._forward.pieces.remember`); held weakly."""
        self._replays[replay] = (weakref.ref(tensor), forward)  # type: ignore[attr-defined]

    def replayed(self, replay: tuple) -> Optional[tuple[Optional[torch.Tensor], Forward]]:
        """``(tensor, forward)`` remembered for ``replay`` (the tensor None where it is gone), or None."""
        found = self._replays.get(replay)  # type: ignore[attr-defined]
        return None if found is None else (found[0](), found[1])

    def enter_execution(self, module: torch.nn.Module, fqn: str, args: tuple) -> None:
        """Open the frame of an execution of ``module`` (canonical FQN ``fqn``) on ``args``, as its pre-hook does
        (a recompute: :class:`keyinit.nn._forward.pieces.CheckpointingFunction`)."""
        self._pre_hook(fqn)(module, args, {})  # type: ignore[attr-defined]

    def leave_execution(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        """Close the frame of ``module``'s execution on ``args`` as its post-hook does (``output`` None: it
        raised)."""
        self._post_hook()(module, args, output)  # type: ignore[attr-defined]

    def planned(self, module: torch.nn.Module) -> Optional[tuple[str, bool]]:
        """``(fqn, light)`` of ``module`` where the block hooked it (and a recompute after the block puts its hooks
        back: its plan), else None."""
        if id(module) not in self._names:
            return None
        return next(((fqn, light) for m, fqn, light in self._plan if m is module), None)

    def repeats(self, module: torch.nn.Module, fqn: str, args: tuple) -> bool:
        """``module`` (FQN ``fqn``), run in backward on ``args``, repeats an execution of this context's forwards
        (its input tensors, or their memory: :func:`keyinit.nn._forward.recomputed`)."""
        return recomputed(self, fqn, args, {}) is not None

    def recompute_unhanded(self, module: torch.nn.Module, fqn: str, light: bool, args: tuple,
                           refuse: Optional[str]) -> Callable[[Any], None]:
        """Run the call of ``module`` that begins now (in backward, by a checkpoint that handed keyinit nothing:
        :mod:`keyinit.nn._context.unhanded`) as a recompute of this context: its hooks on the model for the call
        (:meth:`recomputing`), and the module's frame opened as its pre-hook opens it (keyed as the execution it
        repeats), or, with ``refuse`` (why), a frame whose draws are refused. Returns what closes it, given the
        module's output."""
        scope = self.recomputing()  # type: ignore[attr-defined]
        scope.__enter__()
        try:
            if refuse is None:
                self._pre_hook(fqn, light)(module, args, {})  # type: ignore[attr-defined]
            else:
                state = self.thread_state()
                frame = Frame(module, fqn, refuse, self._unmatched(fqn), {})
                self._open(state, frame, None if state.frames else self._refusing_host(frame, refuse))
        except BaseException:
            scope.__exit__(*sys.exc_info())
            raise

        def leave(output: Any) -> None:
            try:
                self._post_hook()(module, args, output)  # type: ignore[attr-defined]
            finally:
                scope.__exit__(None, None, None)

        return leave

    def _refusing_host(self, frame: Frame, why: str) -> HostRandom:
        """Python's and numpy's generators for a frame whose draws are refused (``why``): a draw from them too."""
        return HostRandom(frame.forward.host_key(self), (f"{frame.describe()} drew from ", f"'s global state: {why}"))

    def _open(self, state: _ThreadState, frame: Frame, host: Optional[HostRandom]) -> None:
        """Push ``frame`` on this thread's stack: ``host`` (or None) entered first, then the modes not active.
        The modes are active only while one of the model's forwards runs: entered by the outermost forward
        (and again by a forward that activation checkpointing recomputes in backward, where the autograd
        engine does not carry torch-function modes), left by its post-hook after them."""
        if host is not None:
            host.__enter__()
            frame.pushed.append(host)
        for mode in state.modes:
            if not mode_is_active(mode):
                mode.__enter__()
                frame.pushed.append(mode)
        state.frames.append(frame)

    def _unmatched(self, fqn: str) -> Forward:
        """The forward of a module run in backward that no execution matches (its draws are refused): records
        of its own, kept by no one."""
        forward = Forward(self, fqn, self.sample_offset, 0, 0)
        forward.probe = True
        return forward

    def _check_sequence_first(self, module: torch.nn.Module, frame: Frame, args: tuple, kwargs: dict) -> None:
        """A sequence-first torch layer inside the model whose input's batch is its dimension 0: the model's
        inputs were read batch-first, which this layer contradicts."""
        tensors = input_tensors(args, kwargs)
        if not tensors:
            return
        rec = record(tensors[0], frame.forward)
        if isinstance(rec, Batch) and rec.dim == 0 and tensors[0].dim() == 3:
            from keyinit.errors import UnkeyedRandomnessError

            raise UnkeyedRandomnessError(
                f"{frame.describe()} is sequence-first (batch_first=False: its input is (sequence, batch, "
                f"features)), but keyinit tracked its {tuple(tensors[0].shape)} input's batch in dimension 0 (the "
                "model's inputs are read batch-first unless declared). Declare the model input's batch dimension "
                "with keyinit.nn.batch_dim(x, 1) before the forward, or build the layer with batch_first=True"
            )

    def _leave_frames(self) -> None:
        owner = self._owner
        if owner is not None:
            for frame in reversed(owner.frames):  # a forward left without its post-hook (e.g. an exception)
                for mode in reversed(frame.pushed):
                    mode.__exit__(None, None, None)
            owner.frames.clear()


class MicroBatch:
    """``ctx.micro_batch(offset)``: root forwards inside hold the rows from ``offset`` (relative to the context's
    ``sample_offset``) on."""

    __slots__ = ("ctx", "offset", "saved")

    def __init__(self, ctx: Any, offset: int) -> None:
        self.ctx, self.offset, self.saved = ctx, offset, 0

    def __enter__(self) -> Any:
        self.saved = self.ctx._rows
        self.ctx._rows = self.offset
        self.ctx._micro += 1
        return self.ctx

    def __exit__(self, *exc_info: Any) -> None:
        self.ctx._rows = self.saved
        self.ctx._micro -= 1
