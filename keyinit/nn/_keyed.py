"""``keyed(model, seed, step=..., sample_offset=...)``: every dropout in ``model``'s forward, keyed.

While the context is active in a thread, and only while one of ``model``'s
modules is running its forward in that thread:

* ``F.dropout``, ``torch.dropout`` (``nn.Dropout``, ``keyinit.nn.Dropout``, HF's
  eager attention), ``F.dropout1d/2d/3d``, ``torch.feature_dropout``,
  ``F.alpha_dropout``, ``F.feature_alpha_dropout`` (and their in-place forms)
  are answered with keyed masks. Call number ``n`` (0, 1, ...) made directly in
  the forward of the module with canonical FQN ``fqn`` uses
  ``dropout_key(seed, step=step, fqn=fqn, ordinal=n)``; calls inside a child module's forward
  belong to the child. The element index is global: dimension 0 of the
  activation is the batch, and local row ``r`` is global sample
  ``sample_offset + r``. DTensor activations add the placements of their other
  dimensions (sequence parallelism).
* ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` and
  ``F.multi_head_attention_forward`` in training with dropout (``nn.MultiheadAttention``,
  the ``nn.Transformer*Layer`` family) are computed by :mod:`keyinit.nn._attention`
  with their attention probabilities dropped as the module's next call
  (``docs/spec.md`` section 14.5): the same mask as an ``F.dropout`` of the
  probabilities.
* Any other random op raises :class:`~keyinit.errors.UnkeyedRandomnessError`
  naming the module and the op: a ``TorchDispatchMode`` checks every ATen op for
  ``torch.Tag.nondeterministic_seeded`` (``rand_like``, ``bernoulli_``,
  ``randperm``, ``native_dropout`` called directly, ...). Ops whose
  ``dropout_p``/``p`` is 0 or whose ``train`` flag is False draw nothing and pass.

Module boundaries come from forward pre-hooks and ``always_call`` forward hooks
registered on every module of ``model`` for the duration of the context. The two
modes are entered by the outermost forward and left when it returns, so code
outside the model's forwards (the loss, the backward pass, the optimizer) runs
without them; a forward that activation checkpointing recomputes during
backward enters them again. The global torch RNG is never read or advanced.

A forward of the model in a thread other than the one that entered the context
gets its own frames and modes, and refuses every draw there
(:class:`~keyinit.errors.UnkeyedRandomnessError` naming the thread). A
``keyed`` on a submodule entered inside a ``keyed`` on its model with the same
values keys nothing more (the outer context keys the submodule by its FQN
there); any other overlap of two active contexts is a ``RuntimeError``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Union

import torch
from torch.overrides import TorchFunctionMode

from keyinit.fqn import canonical_modules
from keyinit.keys import Key, as_uint64 as _as_uint64, key
from keyinit.nn._intercept import _DropoutFunctionMode, _Frame, _SeededOpGuard

__all__ = ["keyed", "Keyed", "inside_keyed_forward"]

_state = threading.local()  # .active: list of Keyed entered in this thread, innermost last
_entered_lock = threading.Lock()
_entered: list = []  # every Keyed entered and not yet exited, in any thread

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
    return any(ctx._current_frame() is not None for ctx in contexts)


# ----------------------------------------------------------------------------- the context


def _mode_is_active(mode: Any) -> bool:
    if isinstance(mode, TorchFunctionMode):
        from torch.overrides import _get_current_function_mode_stack

        return any(m is mode for m in _get_current_function_mode_stack())
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(m is mode for m in _get_current_dispatch_mode_stack())


class _ThreadState:
    """One thread's forwards of a keyed model: its frame stack and its own mode objects."""

    __slots__ = ("frames", "modes", "foreign")

    def __init__(self, ctx: "Keyed", foreign: bool) -> None:
        self.frames: list[_Frame] = []
        self.modes: list[Any] = [_DropoutFunctionMode(ctx), _SeededOpGuard(ctx)]
        self.foreign = foreign


def _module_fqn(root: torch.nn.Module, module: torch.nn.Module) -> Optional[str]:
    """The canonical FQN of ``module`` inside ``root`` (the first path), or None."""
    for _, fqn, candidate in canonical_modules(root):
        if candidate is module:
            return fqn
    return None


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _resolve_sample_offset(model: torch.nn.Module, sample_offset: Optional[int]) -> int:
    """The rule: explicit under more than one process; never 0 on a DDP rank other than 0."""
    if sample_offset is None:
        world = _world()
        if world > 1:
            raise ValueError(
                f"keyed: torch.distributed is initialized with {world} ranks, so sample_offset must be given: the "
                "global index of this rank's first sample in the step's batch (e.g. dp_rank * local_batch + "
                "micro-batch offset), or 0 where every rank holds the whole batch (tensor/sequence parallelism; "
                "DTensor activations add their own placements)"
            )
        return 0
    offset = _as_uint64(sample_offset, "sample_offset")
    if offset == 0 and _world() > 1:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            import torch.distributed as dist

            rank = dist.get_rank(model.process_group)
            if rank > 0:
                raise ValueError(
                    f"keyed: sample_offset=0 on rank {rank} of the DistributedDataParallel group: each data-parallel "
                    "rank holds its own rows of the batch, so its first sample is not global sample 0; pass "
                    "sample_offset = rank * local_batch (+ the micro-batch offset)"
                )
    return offset


def _sequence_first_dropouts(model: torch.nn.Module) -> frozenset[int]:
    """The dropout modules of torch's sequence-first (``batch_first=False``, torch's default)
    ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``: their activations are
    ``(sequence, batch, features)``, so dimension 1, not 0, is the batch."""
    layers = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)
    found = set()
    for module in model.modules():
        if isinstance(module, layers) and not getattr(module.self_attn, "batch_first", True):
            found.update(id(child) for child in module.children() if isinstance(child, torch.nn.Dropout))
    return frozenset(found)


class Keyed:
    """The context manager :func:`keyed` returns (single use; enter it with ``with``)."""

    def __init__(self, model: torch.nn.Module, seed: Union[int, Key], step: int, sample_offset: Optional[int]) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"keyed: model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        #: The root of every dropout key (:func:`keyinit.nn.dropout_key`'s ``seed``); ``key`` checks an int.
        self.root = seed if isinstance(seed, Key) else key(seed)
        self.seed = seed  # as given, for the repr
        self.step = _as_uint64(step, "step")
        self.sample_offset = _resolve_sample_offset(model, sample_offset)
        self._handles: list[Any] = []
        self._thread: Optional[int] = None
        self._local = threading.local()
        self._owner: Optional[_ThreadState] = None
        self._covered_by: Optional["Keyed"] = None  # an outer context that keys this model already
        self._sequence_first: frozenset[int] = frozenset()  # see _sequence_first_dropouts
        self._state = "new"

    def __repr__(self) -> str:
        return (f"keyed({type(self.model).__name__}, seed={self.seed}, step={self.step}, "
                f"sample_offset={self.sample_offset})")

    def _thread_state(self) -> _ThreadState:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ThreadState(self, foreign=threading.get_ident() != self._thread)
        return state

    def _current_frame(self) -> Optional[_Frame]:
        state = getattr(self._local, "state", None)
        if state is not None and state.frames:
            return state.frames[-1]
        return None

    def _pre_hook(self, fqn: str) -> Callable:
        def hook(module: torch.nn.Module, args: Any) -> None:
            state = self._thread_state()
            frame = _Frame(module, fqn, state.foreign)
            # The modes are active only while one of the model's forwards runs: entered by the outermost
            # forward (and again by a forward that activation checkpointing recomputes in backward, where
            # the autograd engine does not carry torch-function modes), exited by its post-hook.
            for mode in state.modes:
                if not _mode_is_active(mode):
                    mode.__enter__()
                    frame.pushed.append(mode)
            state.frames.append(frame)

        return hook

    def _post_hook(self) -> Callable:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            state = getattr(self._local, "state", None)
            if state is None:
                return
            frames = state.frames
            while frames:  # robust to a forward that raised inside a child
                frame = frames.pop()
                for mode in reversed(frame.pushed):
                    mode.__exit__(None, None, None)
                if frame.module is module:
                    break

        return hook

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
        self._owner = self._thread_state()
        seen: set[int] = set()
        try:
            for _, fqn, module in canonical_modules(self.model):
                if id(module) in seen:
                    continue
                seen.add(id(module))
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(fqn)))
                self._handles.append(module.register_forward_hook(self._post_hook(), always_call=True))
            self._sequence_first = _sequence_first_dropouts(self.model)
            _active().append(self)
            with _entered_lock:
                _entered.append(self)
        except BaseException:
            self._teardown()
            self._state = "exited"
            raise
        return self

    def _teardown(self) -> None:
        owner = self._owner
        if owner is not None:
            for frame in reversed(owner.frames):  # a forward left without its post-hook (e.g. an exception)
                for mode in reversed(frame.pushed):
                    mode.__exit__(None, None, None)
            owner.frames.clear()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self in _active():
            _active().remove(self)
        with _entered_lock:
            if self in _entered:
                _entered.remove(self)

    def __exit__(self, *exc_info: Any) -> None:
        self._teardown()
        self._state = "exited"


def keyed(model: torch.nn.Module, seed: Union[int, Key], *, step: int, sample_offset: Optional[int] = None) -> Keyed:
    """Key every dropout in ``model``'s forward by (seed, step, module FQN, call ordinal, global index).

    Use it around each forward (and backward, if activation checkpointing
    recomputes the forward there)::

        with keyinit.nn.keyed(model, seed, step=step, sample_offset=first_sample):
            loss = loss_fn(model(batch), target)
            loss.backward()

    Inside, the ``n``-th dropout-family call made directly in the forward of the
    module with canonical FQN ``fqn`` (``keyinit.fqn.canonical_modules``: wrappers
    such as ``_orig_mod``, ``_checkpoint_wrapped_module`` and DDP's ``module`` are
    stripped) drops element ``i`` iff ``keyinit.random.bernoulli`` with key
    ``dropout_key(seed, step=step, fqn=fqn, ordinal=n)`` and ``p = 1 - p_drop`` is False at ``i``,
    the element's GLOBAL row-major index, where dimension 0 is the batch and
    local row ``r`` is global sample ``sample_offset + r``. So splitting a batch
    across data-parallel ranks, micro-batches or gradient-accumulation steps (each
    with its ``sample_offset``) never changes a mask; DTensor activations also
    add their placements (sequence/tensor parallelism).

    Any other random op in the forward raises
    :class:`keyinit.errors.UnkeyedRandomnessError` naming the module and the op.
    Randomness outside the model's forwards is left alone. The global RNG is
    never read or advanced. ``seed`` is an int in ``[0, 2**64)`` or a
    :class:`keyinit.Key` (the root of every dropout key, as for :func:`dropout_key`);
    ``step`` and ``sample_offset`` are ints in ``[0, 2**64)``.

    ``sample_offset`` defaults to 0 in a single process. When ``torch.distributed``
    is initialized with more than one rank it must be given (a ``ValueError``
    otherwise): keyinit cannot tell data-parallel ranks (each with its own rows)
    from tensor-parallel ones (all with the whole batch). A model wrapped in
    ``DistributedDataParallel`` on a group rank other than 0 refuses
    ``sample_offset=0``. Batch-sharded DTensor activations place their rows
    themselves (their placements add to ``sample_offset``).
    """
    return Keyed(model, seed, step, sample_offset)
