"""What ``keyinit.nn.keyed`` puts around a model's forward: the frames, the dropout family and the two modes.

- :class:`_Frame`: one execution of one module's forward (its FQN and its call counter);
- the dropout family (``F.dropout``, ``torch.dropout``, the channel-wise and alpha
  forms) answered with keyed masks, and attention (SDPA with ``dropout_p > 0``,
  ``F.multi_head_attention_forward``) computed by :mod:`keyinit.nn._attention`;
- :class:`_DropoutFunctionMode`, the ``TorchFunctionMode`` that routes those calls,
  and :class:`_SeededOpGuard`, the ``TorchDispatchMode`` that refuses every other
  random ATen op.

The context itself (hooks, threads, nesting) is :mod:`keyinit.nn._keyed`.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Optional, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from keyinit.errors import UnkeyedRandomnessError
from keyinit.nn._keys import keyed_call_key



class Keyed(Protocol):
    """What the modes here read of the active :class:`keyinit.nn._keyed.Keyed` context (which
    imports this module; this protocol keeps the import one-way)."""

    seed: int
    step: int
    sample_offset: int
    _local: threading.local
    _sequence_first: frozenset[int]  # ids of modules whose activations are (sequence, batch, ...)

    def _current_frame(self) -> Optional["_Frame"]: ...

__all__ = ["_Frame", "_DropoutFunctionMode", "_SeededOpGuard", "_GuardSuspended"]


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
    from keyinit._draw.dropout_geometry import constants
    from keyinit._draw.reference_dropout import apply_mask
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
    key = keyed_call_key(ctx.root, ctx.step, frame.fqn, ordinal)
    # A sequence-first transformer layer's own dropouts see (sequence, batch, ...): dimension 1 is the
    # batch, so the mask is drawn as for the batch-first activation and transposed back.
    sequence_first = (mask == "element" and id(frame.module) in ctx._sequence_first and input.dim() >= 2)
    try:
        if sequence_first:
            out = _keyed_masked(ctx, kind, mask, input.transpose(0, 1), p, key).transpose(0, 1)
        else:
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
    key = keyed_call_key(ctx.root, ctx.step, frame.fqn, frame.calls)
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
    key = keyed_call_key(ctx.root, ctx.step, frame.fqn, frame.calls)
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
