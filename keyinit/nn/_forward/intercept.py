"""What ``keyinit.nn.keyed`` does at a dropout or attention call: frames, keyed masks, each activation's batch.

- :class:`Frame`: one execution of one module's forward (its FQN, its call counter
  and the root forward it belongs to);
- the dropout family (``F.dropout``, ``torch.dropout``, the channel-wise and alpha
  forms) answered with keyed masks over the activation's tracked batch
  (:mod:`keyinit.nn._batch.records`), and attention (SDPA with ``dropout_p > 0``,
  ``F.multi_head_attention_forward``) computed by :mod:`keyinit.nn._ops.attention`.

The modes that route these calls are :mod:`keyinit.nn._forward.modes`; the context itself
(hooks, threads, nesting, micro-batches) is :mod:`keyinit.nn._context.keyed`.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Optional, Protocol, Union

import torch

from keyinit.errors import UnkeyedRandomnessError
from keyinit._draw.dropout_geometry import Layout, constants
from keyinit._draw.names import V2, check_samples, names_strides
from keyinit.nn import functional as KF
from keyinit.nn._batch.records import Batch, Foreign, Unknown, annotate, canonical, record
from keyinit.nn._recompute.checkpoint import refuse_unseen
from keyinit.nn._batch.functorch import unwrapped, wrapped as _wrapped
from keyinit.nn._batch.routed import Routed, routed_draw, routed_layout
from keyinit.regions import row_major_strides



class Keyed(Protocol):
    """What the modes here read of the active :class:`keyinit.nn._context.keyed.Keyed` context (which
    imports this module; this protocol keeps the import one-way)."""

    seed: int
    step: int
    sample_offset: int
    index: str  # "tracked" (the model of the batch) or "dim0" (stream v1's first rule)
    thread_local: threading.local  # each thread's state: thread_local.state (its frames and modes)
    sequence_first: frozenset[int]  # ids of modules whose activations are (sequence, batch, ...)
    #: what its draws become (a :class:`keyinit.nn._forward.drawer.Drawer`, chosen when the context is built:
    #: typed Any here, as that module imports this one)
    drawer: Any

    def current_frame(self) -> Optional["Frame"]: ...

    def thread_state(self) -> Any: ...


__all__ = ["Frame", "activation_batch", "placed"]


class Frame:
    """One execution of one module's forward in a keyed forward: its module, canonical FQN and root forward.

    ``counts`` maps an FQN to the call ordinals its module has taken so far. Under the default rule
    (``keyed(..., calls="forward")``, docs/spec.md 14.4) every frame of one root forward (or of one
    recompute) shares one dict, so a module run twice in a forward goes on numbering its calls and its
    executions never share a key; under ``calls="execution"`` (stream v1's first rule) each frame has
    its own, and the count restarts at each execution.
    """

    __slots__ = ("module", "fqn", "counts", "pushed", "foreign", "forward")

    def __init__(self, module: torch.nn.Module, fqn: str, foreign: Union[bool, str], forward: Any,
                 counts: Optional[dict] = None) -> None:
        self.module = module
        self.fqn = fqn
        self.counts: dict[str, int] = {} if counts is None else counts
        self.pushed: list[Any] = []  # the modes this forward entered (exited by its post-hook)
        # a forward in a thread other than the one that entered the context (True), or a str: why every draw in
        # this frame is refused (a module run in backward that keyinit cannot match to the forward it recomputes)
        self.foreign = foreign
        self.forward = forward  # the root forward (keyinit.nn._context.keyed.Forward) this execution belongs to

    def take(self) -> int:
        """The ordinal of this module's next random call (counted)."""
        counts = self.counts
        ordinal = counts.get(self.fqn, 0)
        counts[self.fqn] = ordinal + 1
        return ordinal

    def key(self, ctx: "Keyed") -> Any:
        """The key of this frame's next random call (its ordinal counted)."""
        return self.forward.call_key(ctx, self.fqn, self.take())

    def describe(self) -> str:
        if getattr(self.module, "_keyinit_block", False):
            return f"keyed block '{self.fqn}'"
        name = f"module '{self.fqn}'" if self.fqn else "the root module"
        return f"{name} ({type(self.module).__name__})"


def refuse_foreign(ctx: "Keyed", frame: Frame, what: str) -> None:
    if isinstance(frame.foreign, str):
        raise UnkeyedRandomnessError(f"{frame.describe()}: {what} {frame.foreign}")
    raise UnkeyedRandomnessError(
        f"{frame.describe()}: {what} in thread {threading.current_thread().name!r}, while {ctx!r} was entered in "
        "another thread. A keyed context keys the forwards of the thread that entered it; in any other thread "
        "(nn.DataParallel replicas, a serving thread) a draw is refused rather than left to torch's global RNG: "
        "enter keyinit.nn.keyed in the thread that runs the forward (with that thread's sample_offset), use "
        "DistributedDataParallel instead of nn.DataParallel, or call model.eval()."
    )


# ----------------------------------------------------------------------------- the dropout family


def argument(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
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


def dropout_family() -> dict[Callable, tuple[str, str, bool]]:
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


def _element_dropout(input: torch.Tensor, p: float, key, rec: Optional[Batch]) -> torch.Tensor:
    """Element-wise keyed dropout of ``input`` whose batch is ``rec`` (None: replicated)."""
    if rec is None:
        return KF.dropout(input, p, rng_key=key)
    if rec.dim == 0 and rec.inner == 1 and (input.dim() == 0 or int(input.shape[0]) == rec.count):
        return KF.dropout_rows(input, p, key, rec.start)  # stream v1's rows (docs/spec.md 14.4)
    if KF.is_dtensor(input):
        raise TypeError(f"keyinit.nn.keyed: dropout of a DTensor whose batch is {rec} (not its dimension 0) is not "
                        "supported; keep the batch in dimension 0 of DTensor activations")
    KF.check_input(input)
    split, order, sample_shape = canonical(tuple(input.shape), rec)
    if key.stream == V2:  # extent-free names (docs/spec.md 14.8)
        check_samples(rec.start, rec.count)
        strides, high = names_strides(sample_shape)
    else:
        strides, high = row_major_strides((rec.start + rec.count,) + sample_shape), ()
    # the split dims (before..., outer, count, inner, after...) in the canonical (sample, before..., outer,
    # inner, after...) tensor: sample is canonical dim 0, the others follow in order
    gstrides = tuple(strides[order.index(i)] for i in range(len(split)))
    hstrides = tuple(high[order.index(i)] for i in range(len(split))) if high else ()
    starts = tuple(rec.start if order.index(i) == 0 else 0 for i in range(len(split)))
    layout = Layout(gstrides, starts, (None,) * len(split), hstrides)
    out = KF.run_layout(input.reshape(split).contiguous(), p, key, layout)
    return out.reshape(input.shape)


def masked_keep(kind: str, mask: str, input: torch.Tensor, p: float, key,
                rec: Optional[Batch]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(keep, x, unsqueezed)`` of a channel-wise or alpha dropout (``mask`` not ``element``): the keep
    mask over the rows of ``x`` (``input``, with a batch dimension added where torch adds one)."""
    from keyinit.random import bernoulli

    x, unsqueezed = _feature_input(kind, input) if mask == "feature" else (input, False)
    if x.dim() < 1 or (mask in ("feature", "feature_alpha") and x.dim() < 2):
        raise RuntimeError(f"{kind}: feature dropout needs at least 2 dimensions (batch, channel), got {x.dim()}")
    rows = x.shape[0]
    if rec is None:
        first = 0
    elif rec.dim == 0 and rec.inner == 1 and rows == rec.count:
        first = rec.start
    else:
        raise TypeError(f"{kind} of an activation whose batch is {rec}: channel-wise and alpha dropout key rows "
                        "of dimension 0, so keep the batch there (or declare it: keyinit.nn.batch_dim)")
    if mask in ("feature", "feature_alpha"):
        shape = (first + rows, x.shape[1])
        region = (slice(first, None), slice(None))
    else:
        shape = (first + rows, *x.shape[1:])
        region = (slice(first, None),) + (slice(None),) * (x.dim() - 1)
    if key.stream == V2 and rec is not None:  # extent-free names (docs/spec.md 14.8): the rows' samples
        from keyinit._draw.names import named_words

        threshold = constants(p)[0]
        keep = (named_words(key, first, shape[1:], rows, 1)[0] < threshold).to(x.device)
    else:
        keep = bernoulli(key, shape, p=1.0 - p, region=region, device=x.device)
    if mask in ("feature", "feature_alpha"):
        keep = keep.view(*keep.shape, *([1] * (x.dim() - 2)))
    return keep, x, unsqueezed


def alpha_scale(p: float) -> float:
    """``a = 1/sqrt((alpha^2 p + 1)(1 - p))`` of the alpha forms (kept ``x -> a*x + a*alpha*p``)."""
    return 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1.0) * (1.0 - p))


def keyed_masked(kind: str, mask: str, input: torch.Tensor, p: float, key, rec: Optional[Batch]) -> torch.Tensor:
    """The keyed dropout of ``input`` whose batch is ``rec`` (None: replicated), of the family member
    ``kind`` with mask form ``mask`` (``element``, ``feature``, ``alpha``, ``feature_alpha``)."""
    if mask == "element":
        return _element_dropout(input, p, key, rec)
    from keyinit._draw.reference_dropout import apply_mask

    if KF.is_dtensor(input):
        raise TypeError(
            f"keyinit.nn.keyed: {kind} of a DTensor is not supported (only element-wise dropout of DTensors is); "
            "call it on the local tensor with keyinit.nn.functional.dropout and an explicit region"
        )
    KF.check_input(input)
    keep, x, unsqueezed = masked_keep(kind, mask, input, p, key, rec)
    if mask == "feature":
        _, scale32, scale64 = constants(p)
        out = apply_mask(x, keep, scale32, scale64)
        return out.squeeze(0) if unsqueezed else out
    # alpha forms: kept x -> a*x + a*alpha*p, dropped -> a*alpha*(p - 1), a = 1/sqrt((alpha^2 p + 1)(1 - p))
    if p == 1.0:  # torch: input * 0
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    a = alpha_scale(p)
    dropped = torch.full((), _ALPHA * a * (p - 1.0), dtype=x.dtype, device=x.device)
    return torch.where(keep, x * a + _ALPHA * a * p, dropped)


def handle_dropout(ctx: "Keyed", frame: Frame, kind: str, mask: str, inplace_op: bool, args: tuple,
                    kwargs: dict) -> torch.Tensor:
    ordinal = frame.take()  # every call of the family takes one, also one that draws nothing (14.4)
    input = argument(args, kwargs, 0, "input", None)
    if kind.startswith("torch."):
        p = argument(args, kwargs, 1, "p", None)
        training = argument(args, kwargs, 2, "train", None)
        inplace = inplace_op
    else:
        p = argument(args, kwargs, 1, "p", 0.5)
        training = argument(args, kwargs, 2, "training", _FUNCTIONAL_DEFAULT_TRAINING.get(kind, True))
        inplace = bool(argument(args, kwargs, 3, "inplace", False))
    p = KF.check_p(p)
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{kind}: input must be a torch.Tensor, got {type(input).__name__}")
    if not training or p == 0.0:
        return input
    if frame.foreign:
        refuse_foreign(ctx, frame, f"{kind}(p={p})")
    refuse_unseen(frame, f"{kind}(p={p})")
    key = frame.forward.call_key(ctx, frame.fqn, ordinal)
    if _wrapped(input) and unwrapped(input) is None:  # torch.func.vmap: the samples are the vmapped dimension
        return _vmapped_dropout(ctx, frame, kind, mask, inplace, input, p, key)
    routed = record(input, frame.forward) if ctx.index != "dim0" and mask == "element" else None
    if type(routed) is Routed:
        out = _routed_dropout(ctx, frame, kind, input, p, key, routed)
        if inplace:
            input.copy_(out)
            return input
        return out
    rec = activation_batch(ctx, frame, input, kind)
    try:
        out = ctx.drawer.masked(kind, mask, input, p, key, rec)
    except (ValueError, TypeError, RuntimeError) as exc:
        if type(exc) not in (ValueError, TypeError, RuntimeError):
            raise
        raise type(exc)(f"{frame.describe()}: {kind} under keyinit.nn.keyed: {exc}") from exc
    if inplace:
        input.copy_(out)
        return input
    annotate(out, frame.forward, rec)
    return out


def _vmapped_dropout(ctx: "Keyed", frame: Frame, kind: str, mask: str, inplace: bool, input: torch.Tensor,
                     p: float, key: Any) -> torch.Tensor:
    """Element-wise keyed dropout of a tensor of ``torch.func.vmap`` (keyinit.nn._batch.functorch): the keep mask of
    its physical tensor (each sample's row of the batched forward), wrapped at the vmap level and applied with
    14.3's arithmetic by torch ops (so every torch.func level above sees its gradient)."""
    from keyinit._draw.reference_dropout import apply_mask
    from keyinit.nn._batch.functorch import describe, vmap_levels, vmapped_mask

    physical, levels = vmap_levels(input)
    what = f"{kind}(p={p})"
    if mask != "element" or len(levels) != 1 or not ctx.drawer.eager:
        raise UnkeyedRandomnessError(
            f"{frame.describe()}: {what} on {describe(input)}: under torch.func.vmap keyinit keys element-wise "
            "dropout (one vmap level over the samples, not compiled), not channel-wise or alpha dropout; call the "
            "model on the whole batch (torch.func.grad, vjp, jacrev and functional_call keep the batch)")
    level, bdim = levels[0]
    rec = placed(frame, record(physical, frame.forward), what, tuple(physical.shape))
    KF.check_input(input)
    with torch._C._DisableFuncTorch(), torch._C.DisableTorchFunction():
        ones = torch.ones(physical.shape, dtype=physical.dtype, device=physical.device)
        keep = keyed_masked(kind, mask, ones, p, key, rec) != 0
    _, scale32, scale64 = constants(p)
    out = apply_mask(input, vmapped_mask(keep, level, bdim), scale32, scale64)
    if inplace:
        input.copy_(out)
        return input
    out_physical, out_levels = vmap_levels(out)
    if rec is not None and len(out_levels) == 1:
        annotate(out_physical, frame.forward, _vmap_moved(rec, bdim, out_levels[0][1]))
    return out


def _vmap_moved(rec: Batch, was: int, now: int) -> Batch:
    """``rec`` of a physical tensor whose vmap dimension moved from ``was`` to ``now`` (the others in order)."""
    if rec.dim is None or was == now:
        return rec
    if rec.dim == was:
        return rec.moved(now)
    logical = rec.dim - (rec.dim > was)
    return rec.moved(logical + (logical >= now))


def _routed_dropout(ctx: "Keyed", frame: Frame, kind: str, input: torch.Tensor, p: float, key: Any,
                    rec: Routed) -> torch.Tensor:
    """Element-wise keyed dropout of rows picked from the batch by values: each element keyed as the same
    element of the virtual tensor, the rows in their place in the batch (keyinit.nn._batch.routed)."""
    ctx.drawer.on_values(frame, f"{kind} of rows picked by values")  # (traced: refused, the graph runs eagerly)
    if KF.is_dtensor(input):
        raise UnkeyedRandomnessError(
            f"{frame.describe()}: {kind} on a DTensor of rows picked from the batch by index values: keyinit keys "
            "such rows only as plain tensors; apply the dropout before the rows are picked or after they are "
            "written back")
    routed_draw(frame, rec, kind, tuple(input.shape))  # (refused: rows known only by samples, or picked twice)
    KF.check_input(input)
    if key.stream == V2:  # extent-free names (docs/spec.md 14.8) of the virtual tensor, read at the rows
        out = _routed_dropout_named(input, p, key, rec)
    else:
        out = KF.run_layout(input.contiguous(), p, key, routed_layout(tuple(input.shape), rec))
    annotate(out, frame.forward, rec)
    return out


def _routed_dropout_named(input: torch.Tensor, p: float, key: Any, rec: Routed) -> torch.Tensor:
    """Stream v2's dropout of routed rows: the keep-mask of the virtual tensor's elements (their names,
    docs/spec.md 14.8) read at the rows, applied with 14.3's arithmetic by torch ops (so autograd gives
    ``keep ? dy * s : +0``)."""
    from keyinit._draw.names import named_words
    from keyinit._draw.reference_dropout import apply_mask
    from keyinit.nn._forward.draws import routed_rows

    rows = routed_rows(tuple(input.shape), rec)
    threshold, scale32, scale64 = constants(p)
    with torch._C.DisableTorchFunction():
        keep = rows.from_canonical(named_words(key, rows.start, rows.local[1:], rows.count)[0] < threshold)
    return apply_mask(input, keep.to(input.device), scale32, scale64)


def activation_batch(ctx: "Keyed", frame: Frame, tensor: torch.Tensor, what: str) -> Optional[Batch]:
    """The batch of ``tensor`` (None: replicated), or an UnkeyedRandomnessError when it is unknown.

    With ``index="dim0"`` (stream v1's first rule, kept selectable) dimension 0 is read as the batch
    (dimension 1 in the dropouts of torch's sequence-first transformer layers).
    """
    if ctx.index == "dim0":
        if tensor.dim() == 0:
            return None
        dim = 1 if id(frame.module) in ctx.sequence_first and tensor.dim() >= 2 else 0
        return Batch(dim, int(tensor.shape[dim]), frame.forward.start)
    return placed(frame, record(tensor, frame.forward), what, tuple(tensor.shape))


def placed(frame: Frame, rec: Any, what: str, shape: tuple) -> Optional[Batch]:
    """``rec`` when it places every sample (a batch, or None: replicated); else the
    UnkeyedRandomnessError of ``what`` (a draw on a ``shape`` tensor) naming the frame and why."""
    if isinstance(rec, Foreign):
        rec = Unknown("it entered the forward from outside: not one of the model's inputs, parameters or buffers, "
                      "nor computed in the forward from them (e.g. a forward hook's replacement output)")
    if isinstance(rec, Unknown):
        raise UnkeyedRandomnessError(
            f"{frame.describe()}: {what} on a {shape or 'sized'} tensor whose samples keyinit cannot place: "
            f"{rec.why}. keyinit keys a draw by the sample of each element and does not guess it from shapes; "
            "declare where the batch is with keyinit.nn.batch_dim(tensor, dim) (or batch_dim(tensor, None) for "
            "a tensor that is the same for every sample) before the draw"
        )
    return rec


# ----------------------------------------------------------------------------- modes


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _probs_start(ctx: "Keyed", frame: Frame, query: torch.Tensor, batch_dim: int, what: str) -> tuple[int, Optional[Batch]]:
    """The global sample of the attention probabilities' row 0, from the query's batch."""
    rec = activation_batch(ctx, frame, query, what)
    if rec is None:
        return 0, None
    one_row = rec.dim is None and query.dim() > batch_dim and int(query.shape[batch_dim]) == 1  # (sample start's)
    if ctx.index != "dim0" and not one_row and not (rec.dim == batch_dim and rec.inner == 1 and query.dim() > batch_dim
                                                    and int(query.shape[batch_dim]) == rec.count):
        raise UnkeyedRandomnessError(
            f"{frame.describe()}: {what}: the query's batch is {rec}, but attention dropout keys the probabilities "
            f"by dimension {batch_dim} of the query; declare the batch with keyinit.nn.batch_dim"
        )
    return rec.start, rec


def _probs_drop(ctx: "Keyed", p: float, key: Any, start: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The dropout of attention probabilities whose row 0 is sample ``start`` (a site op when tracing)."""
    return ctx.drawer.rows_drop(p, key, start)


def keyed_sdpa(ctx: "Keyed", frame: Frame, p: float, args: tuple, kwargs: dict) -> torch.Tensor:
    """SDPA with ``dropout_p > 0``: the next call ordinal of the module, probabilities dropped by rows."""
    from keyinit.nn._ops.attention import attend

    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_ARGS, args))
    bound.update(kwargs)
    extra = set(bound) - set(_SDPA_ARGS)
    if extra:
        raise TypeError(f"scaled_dot_product_attention: unexpected arguments {sorted(extra)}")
    if frame.foreign:
        refuse_foreign(ctx, frame, f"scaled_dot_product_attention(dropout_p={p})")
    refuse_unseen(frame, f"scaled_dot_product_attention(dropout_p={p})")
    key = frame.key(ctx)
    start, rec = _probs_start(ctx, frame, bound["query"], 0, "scaled_dot_product_attention")
    drop = _probs_drop(ctx, p, key, start)
    try:
        for name in ("query", "key", "value"):
            KF.check_input(bound[name])
        out = attend(bound["query"], bound["key"], bound["value"], bound["attn_mask"], bool(bound["is_causal"]),
                     bound["scale"], bool(bound["enable_gqa"]), drop)[0]
        annotate(out, frame.forward, rec)
        return out
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{frame.describe()}: scaled_dot_product_attention under keyinit.nn.keyed: {exc}") from exc


def keyed_mha(ctx: "Keyed", frame: Frame, args: tuple, kwargs: dict) -> Any:
    """``F.multi_head_attention_forward`` in training with dropout: answered by keyed attention, or None."""
    from keyinit.nn._ops.attention import mha_arguments, mha_forward

    bound = mha_arguments(args, kwargs)
    p = KF.check_p(bound["dropout_p"])
    if not bound["training"] or p == 0.0:
        return None
    if frame.foreign:
        refuse_foreign(ctx, frame, f"multi-head attention with dropout {p}")
    refuse_unseen(frame, f"multi-head attention with dropout {p}")
    key = frame.key(ctx)
    query = bound["query"]
    # F.multi_head_attention_forward takes (L, B, E): nn.MultiheadAttention(batch_first=True) transposes first
    start, rec = _probs_start(ctx, frame, query, 1 if query.dim() == 3 else -1, "multi-head attention")
    try:
        out = mha_forward(bound, _probs_drop(ctx, p, key, start))
        if isinstance(out, tuple):
            annotate(out[0], frame.forward, rec)
            if rec is not None and out[1] is not None:
                annotate(out[1], frame.forward, Batch(0, rec.count, rec.start))
        return out
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{frame.describe()}: multi-head attention under keyinit.nn.keyed: {exc}") from exc


