"""``keyed(model, seed, step=..., sample_offset=...)``: every dropout in ``model``'s forward, keyed.

While the context is active in a thread, and only while one of ``model``'s
modules is running its forward in that thread:

* ``F.dropout``, ``torch.dropout`` (``nn.Dropout``, ``keyinit.nn.Dropout``, HF's
  eager attention), ``F.dropout1d/2d/3d``, ``torch.feature_dropout``,
  ``F.alpha_dropout``, ``F.feature_alpha_dropout`` (and their in-place forms)
  are answered with keyed masks. Call number ``n`` (0, 1, ...) made directly in
  the forward of the module with canonical FQN ``fqn`` uses
  ``dropout_key(seed, step, fqn, n)``; calls inside a child module's forward
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

import math
import threading
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from keyinit.errors import UnkeyedRandomnessError
from keyinit.fqn import canonical_modules
from keyinit.keys import _as_uint64
from keyinit.nn._keys import keyed_call_key

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


class _Frame:
    __slots__ = ("module", "fqn", "calls", "pushed", "foreign")

    def __init__(self, module: torch.nn.Module, fqn: str, foreign: bool) -> None:
        self.module = module
        self.fqn = fqn
        self.calls = 0
        self.pushed: list[Any] = []  # the modes this forward entered (exited by its post-hook)
        self.foreign = foreign  # a forward in a thread other than the one that entered the context

    def describe(self) -> str:
        name = f"module '{self.fqn}'" if self.fqn else "the root module"
        return f"{name} ({type(self.module).__name__})"


def _refuse_foreign(ctx: "Keyed", frame: _Frame, what: str) -> None:
    raise UnkeyedRandomnessError(
        f"{frame.describe()}: {what} in thread {threading.current_thread().name!r}, while {ctx!r} was entered in "
        "another thread. A keyed context keys the forwards of the thread that entered it; in any other thread "
        "(nn.DataParallel replicas, a serving thread) a draw is refused rather than left to torch's global RNG: "
        "enter keyinit.nn.keyed in the thread that runs the forward (with that thread's sample_offset), use "
        "DistributedDataParallel instead of nn.DataParallel, or call model.eval()."
    )


# ----------------------------------------------------------------------------- the dropout family


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _feature_input(kind: str, input: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """F.dropout1d/3d add a batch dimension to unbatched inputs (as torch does); dropout2d does not."""
    dim = input.dim()
    if kind == "dropout1d":
        if dim not in (2, 3):
            raise RuntimeError(f"dropout1d: Expected 2D or 3D input, but received a {dim}D input")
        return (input.unsqueeze(0), True) if dim == 2 else (input, False)
    if kind == "dropout3d" and dim == 4:
        return input.unsqueeze(0), True
    return input, False


def _dropout_family() -> dict[Callable, tuple[str, str, bool]]:
    """``{function: (kind, mask, inplace)}``; ``mask`` is ``element``, ``feature`` or their alpha forms."""
    F = torch.nn.functional
    table: dict[Callable, tuple[str, str, bool]] = {
        F.dropout: ("dropout", "element", False),
        F.dropout1d: ("dropout1d", "feature", False),
        F.dropout2d: ("dropout2d", "feature", False),
        F.dropout3d: ("dropout3d", "feature", False),
        F.alpha_dropout: ("alpha_dropout", "alpha", False),
        F.feature_alpha_dropout: ("feature_alpha_dropout", "feature_alpha", False),
    }
    for name, mask in (("dropout", "element"), ("feature_dropout", "feature"), ("alpha_dropout", "alpha"),
                       ("feature_alpha_dropout", "feature_alpha")):
        for suffix, inplace in (("", False), ("_", True)):
            function = getattr(torch, name + suffix, None)
            if function is not None:
                table[function] = (f"torch.{name}{suffix}", mask, inplace)
    return table


_FUNCTIONAL_DEFAULT_TRAINING = {"alpha_dropout": False, "feature_alpha_dropout": False}
_ALPHA = 1.7580993408473766  # SELU's -alpha * scale, as in torch's alpha_dropout


def _keyed_masked(ctx: "Keyed", kind: str, mask: str, input: torch.Tensor, p: float, key) -> torch.Tensor:
    from keyinit.nn import functional as KF
    from keyinit.nn._geometry import constants
    from keyinit.nn._reference import apply_mask
    from keyinit.random import bernoulli

    if mask == "element":
        return KF._dropout_rows(input, p, key, ctx.sample_offset)
    if KF._is_dtensor(input):
        raise TypeError(
            f"keyinit.nn.keyed: {kind} of a DTensor is not supported (only element-wise dropout of DTensors is); "
            "call it on the local tensor with keyinit.nn.functional.dropout and an explicit region"
        )
    KF._check_input(input)
    x, unsqueezed = _feature_input(kind, input) if mask == "feature" else (input, False)
    if x.dim() < 1 or (mask in ("feature", "feature_alpha") and x.dim() < 2):
        raise RuntimeError(f"{kind}: feature dropout needs at least 2 dimensions (batch, channel), got {x.dim()}")
    rows = x.shape[0]
    if mask in ("feature", "feature_alpha"):
        shape = (ctx.sample_offset + rows, x.shape[1])
        region = (slice(ctx.sample_offset, None), slice(None))
    else:
        shape = (ctx.sample_offset + rows, *x.shape[1:])
        region = (slice(ctx.sample_offset, None),) + (slice(None),) * (x.dim() - 1)
    keep = bernoulli(key, shape, p=1.0 - p, region=region, device=x.device)
    if mask in ("feature", "feature_alpha"):
        keep = keep.view(*keep.shape, *([1] * (x.dim() - 2)))
    if mask == "feature":
        _, scale32, scale64 = constants(p)
        out = apply_mask(x, keep, scale32, scale64)
        return out.squeeze(0) if unsqueezed else out
    # alpha forms: kept x -> a*x + a*alpha*p, dropped -> a*alpha*(p - 1), a = 1/sqrt((alpha^2 p + 1)(1 - p))
    if p == 1.0:  # torch: input * 0
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1.0) * (1.0 - p))
    dropped = torch.full((), _ALPHA * a * (p - 1.0), dtype=x.dtype, device=x.device)
    return torch.where(keep, x * a + _ALPHA * a * p, dropped)


def _handle_dropout(ctx: "Keyed", frame: _Frame, kind: str, mask: str, inplace_op: bool, args: tuple,
                    kwargs: dict) -> torch.Tensor:
    from keyinit.nn.functional import _check_p

    ordinal = frame.calls
    frame.calls += 1
    input = _arg(args, kwargs, 0, "input", None)
    if kind.startswith("torch."):
        p = _arg(args, kwargs, 1, "p", None)
        training = _arg(args, kwargs, 2, "train", None)
        inplace = inplace_op
    else:
        p = _arg(args, kwargs, 1, "p", 0.5)
        training = _arg(args, kwargs, 2, "training", _FUNCTIONAL_DEFAULT_TRAINING.get(kind, True))
        inplace = bool(_arg(args, kwargs, 3, "inplace", False))
    p = _check_p(p)
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{kind}: input must be a torch.Tensor, got {type(input).__name__}")
    if not training or p == 0.0:
        return input
    if frame.foreign:
        _refuse_foreign(ctx, frame, f"{kind}(p={p})")
    key = keyed_call_key(ctx.seed, ctx.step, frame.fqn, ordinal)
    try:
        out = _keyed_masked(ctx, kind, mask, input, p, key)
    except (ValueError, TypeError, RuntimeError) as exc:
        if type(exc) not in (ValueError, TypeError, RuntimeError):
            raise
        raise type(exc)(f"{frame.describe()}: {kind} under keyinit.nn.keyed: {exc}") from exc
    if inplace:
        input.copy_(out)
        return input
    return out


# ----------------------------------------------------------------------------- modes


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _keyed_sdpa(ctx: "Keyed", frame: _Frame, p: float, args: tuple, kwargs: dict) -> torch.Tensor:
    """SDPA with ``dropout_p > 0``: the next call ordinal of the module, probabilities dropped by rows."""
    from keyinit.nn import functional as KF
    from keyinit.nn._attention import attend

    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_ARGS, args))
    bound.update(kwargs)
    extra = set(bound) - set(_SDPA_ARGS)
    if extra:
        raise TypeError(f"scaled_dot_product_attention: unexpected arguments {sorted(extra)}")
    if frame.foreign:
        _refuse_foreign(ctx, frame, f"scaled_dot_product_attention(dropout_p={p})")
    key = keyed_call_key(ctx.seed, ctx.step, frame.fqn, frame.calls)
    frame.calls += 1
    drop = KF._probs_drop(p, key, None, ctx.sample_offset)
    try:
        for name in ("query", "key", "value"):
            KF._check_input(bound[name])
        return attend(bound["query"], bound["key"], bound["value"], bound["attn_mask"], bool(bound["is_causal"]),
                      bound["scale"], bool(bound["enable_gqa"]), drop)[0]
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{frame.describe()}: scaled_dot_product_attention under keyinit.nn.keyed: {exc}") from exc


def _keyed_mha(ctx: "Keyed", frame: _Frame, args: tuple, kwargs: dict) -> Any:
    """``F.multi_head_attention_forward`` in training with dropout: answered by keyed attention, or None."""
    from keyinit.nn import functional as KF
    from keyinit.nn._attention import mha_arguments, mha_forward

    bound = mha_arguments(args, kwargs)
    p = KF._check_p(bound["dropout_p"])
    if not bound["training"] or p == 0.0:
        return None
    if frame.foreign:
        _refuse_foreign(ctx, frame, f"multi-head attention with dropout {p}")
    key = keyed_call_key(ctx.seed, ctx.step, frame.fqn, frame.calls)
    frame.calls += 1
    try:
        return mha_forward(bound, KF._probs_drop(p, key, None, ctx.sample_offset))
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{frame.describe()}: multi-head attention under keyinit.nn.keyed: {exc}") from exc


class _DropoutFunctionMode(TorchFunctionMode):
    """Answers the dropout family, SDPA with ``dropout_p > 0`` and multi-head attention with keyed masks."""

    def __init__(self, ctx: "Keyed") -> None:
        super().__init__()
        self.ctx = ctx
        self.family = _dropout_family()
        self.sdpa = torch.nn.functional.scaled_dot_product_attention
        self.mha = torch.nn.functional.multi_head_attention_forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = self.family.get(func)
        if entry is not None:
            frame = self.ctx._current_frame()
            if frame is not None:
                with _GuardSuspended(self.ctx):
                    return _handle_dropout(self.ctx, frame, *entry, args, kwargs)
        elif func is self.sdpa:
            dropout_p = _arg(args, kwargs, 4, "dropout_p", 0.0)
            frame = self.ctx._current_frame()
            if frame is not None and dropout_p:
                from keyinit.nn.functional import _check_p

                with _GuardSuspended(self.ctx):
                    return _keyed_sdpa(self.ctx, frame, _check_p(dropout_p), args, kwargs)
        elif func is self.mha:
            frame = self.ctx._current_frame()
            if frame is not None:
                with _GuardSuspended(self.ctx):
                    out = _keyed_mha(self.ctx, frame, args, kwargs)
                if out is not None:
                    return out
        return func(*args, **kwargs)


class _GuardSuspended:
    """Leaves this thread's seeded-op guard while keyinit's own code (which draws nothing unkeyed) runs.

    Every ATen op under a Python dispatch mode costs a trip through Python, and the
    ``keyinit::dropout`` custom op takes torch's slow path there; keyinit's handlers
    only run keyed ops, torch's matmul/softmax and projections. Only when the guard is
    the innermost dispatch mode (so no other mode's order changes).
    """

    __slots__ = ("guard",)

    def __init__(self, ctx: "Keyed") -> None:
        state = getattr(ctx._local, "state", None)
        guard = state.modes[-1] if state is not None and state.modes else None
        self.guard = guard if guard is not None and _current_dispatch_mode() is guard else None

    def __enter__(self) -> None:
        if self.guard is not None:
            self.guard.__exit__(None, None, None)

    def __exit__(self, *exc_info: Any) -> None:
        if self.guard is not None:
            self.guard.__enter__()


def _current_dispatch_mode() -> Any:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def _draws_nothing(func, args: tuple, kwargs: dict) -> bool:
    """A seeded op that provably draws nothing: ``dropout_p``/``p`` equal to 0, or ``train``/``training`` False."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    for position, argument in enumerate(schema.arguments):
        if argument.name not in ("dropout_p", "p", "train", "training"):
            continue
        if position < len(args):
            value = args[position]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        elif argument.has_default_value():
            value = argument.default_value
        else:
            continue
        if argument.name in ("train", "training"):
            if value is False:
                return True
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0:
            return True
    return False


class _SeededOpGuard(TorchDispatchMode):
    """Raises on every ATen op tagged ``nondeterministic_seeded`` run inside one of the model's forwards."""

    def __init__(self, ctx: "Keyed") -> None:
        super().__init__()
        self.ctx = ctx

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            frame = self.ctx._current_frame()
            if frame is not None and not _draws_nothing(func, args, kwargs):
                if frame.foreign:
                    _refuse_foreign(self.ctx, frame, str(func))
                raise UnkeyedRandomnessError(
                    f"{frame.describe()}: {func} inside a keyinit.nn.keyed forward draws from torch's random "
                    "number generator, which keyinit cannot key (the values would depend on the RNG state and "
                    "on the layout). Only dropout (F.dropout, torch.dropout, nn.Dropout*, keyinit.nn.Dropout) and "
                    "attention dropout (F.scaled_dot_product_attention, nn.MultiheadAttention, nn.Transformer*Layer) "
                    "are keyed; for other noise use keyinit.random with a key from keyinit.nn.dropout_key."
                )
        return func(*args, **kwargs)


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


class Keyed:
    """The context manager :func:`keyed` returns (single use; enter it with ``with``)."""

    def __init__(self, model: torch.nn.Module, seed: int, step: int, sample_offset: Optional[int]) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"keyed: model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.seed = _as_uint64(seed, "seed")
        self.step = _as_uint64(step, "step")
        self.sample_offset = _resolve_sample_offset(model, sample_offset)
        self._handles: list[Any] = []
        self._thread: Optional[int] = None
        self._local = threading.local()
        self._owner: Optional[_ThreadState] = None
        self._covered_by: Optional["Keyed"] = None  # an outer context that keys this model already
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
                same = (outer.seed, outer.step, outer.sample_offset) == (self.seed, self.step, self.sample_offset)
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


def keyed(model: torch.nn.Module, seed: int, *, step: int, sample_offset: Optional[int] = None) -> Keyed:
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
    ``dropout_key(seed, step, fqn, n)`` and ``p = 1 - p_drop`` is False at ``i``,
    the element's GLOBAL row-major index, where dimension 0 is the batch and
    local row ``r`` is global sample ``sample_offset + r``. So splitting a batch
    across data-parallel ranks, micro-batches or gradient-accumulation steps (each
    with its ``sample_offset``) never changes a mask; DTensor activations also
    add their placements (sequence/tensor parallelism).

    Any other random op in the forward raises
    :class:`keyinit.errors.UnkeyedRandomnessError` naming the module and the op.
    Randomness outside the model's forwards is left alone. The global RNG is
    never read or advanced. ``seed``, ``step`` and ``sample_offset`` are ints in
    ``[0, 2**64)``.

    ``sample_offset`` defaults to 0 in a single process. When ``torch.distributed``
    is initialized with more than one rank it must be given (a ``ValueError``
    otherwise): keyinit cannot tell data-parallel ranks (each with its own rows)
    from tensor-parallel ones (all with the whole batch). A model wrapped in
    ``DistributedDataParallel`` on a group rank other than 0 refuses
    ``sample_offset=0``. Batch-sharded DTensor activations place their rows
    themselves (their placements add to ``sample_offset``).
    """
    return Keyed(model, seed, step, sample_offset)
