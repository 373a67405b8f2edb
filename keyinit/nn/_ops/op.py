"""The ``keyinit::dropout`` operator: a ``torch.library`` custom op with a fake kernel and autograd.

    keyinit::dropout(Tensor input, int k0, int k1, float p, int[] gstrides, int[] starts,
                     Tensor?[] indices, str stream) -> Tensor

returns the keyed dropout of ``input`` (contiguous, same shape and dtype) for the
key ``(k0, k1)`` of stream version ``stream`` (the key's own: it is never reduced
to its two words), with the input's elements placed in the global stream by the
layout ``(gstrides, starts, indices)`` (see :mod:`keyinit._draw.dropout_geometry`).

Autograd: the op is linear in ``input`` with a diagonal 0 / ``1/(1-p)`` Jacobian,
so its backward is the same op applied to the gradient: the mask is
regenerated from the key, and nothing of the input's size is saved (only the
optional per-dimension index vectors). It is its own double backward.

Being a custom op with a fake kernel, it traces under ``torch.compile``
(``fullgraph=True``) as one opaque node; the key words and ``p`` are
compile-time constants there, so a new key means a new graph.

Implementations, all bit-identical, chosen by :func:`keyinit._draw.dispatch.dropout`:
the C kernel on CPU (:mod:`keyinit._kernels.dropout.cpu`), Triton on CUDA
(:mod:`keyinit._kernels.dropout.triton`), and the torch reference
(:mod:`keyinit._draw.reference_dropout`) anywhere else or with ``KEYINIT_DISABLE_KERNELS=1``.
"""

from collections.abc import Sequence
from typing import Optional

import attrs
import torch

from keyinit._draw import dispatch
from keyinit.keys import DEFAULT_STREAM, Key
from keyinit._draw.dropout_geometry import Geometry, make_geometry as plan, rows_layout, rows_template, with_key

__all__ = ["dropout", "run", "call", "call_rows"]

# ``stream`` has no default: the dispatcher drops arguments equal to their default before autograd,
# which would make the backward's gradient count depend on the stream.
_SCHEMA = ("(Tensor input, int k0, int k1, float p, int[] gstrides, int[] starts, Tensor?[] indices, "
           "str stream, int[] hstrides) -> Tensor")


def run(x: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """Dropout of ``x`` by ``geometry`` with the best implementation for its device (a new contiguous tensor):
    :func:`keyinit._draw.dispatch.dropout`, the one seam of every kernel family."""
    return dispatch.dropout(x, geometry)


@torch.library.custom_op("keyinit::dropout", mutates_args=(), schema=_SCHEMA)
def dropout(input: torch.Tensor, k0: int, k1: int, p: float, gstrides: list, starts: list,
            indices: list, stream: str, hstrides: list) -> torch.Tensor:
    """Keyed dropout of ``input``; see the module docstring (``hstrides``: the high counter words' strides of
    docs/spec.md 14.8's names, empty for none)."""
    return run(input, plan(input.shape, k0, k1, p, gstrides, starts, indices, stream,
                           hstrides if any(hstrides) else ()))


@dropout.register_fake
def _(input: torch.Tensor, k0: int, k1: int, p: float, gstrides: list, starts: list,
      indices: list, stream: str, hstrides: list) -> torch.Tensor:
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


def _setup_context(ctx, inputs, output) -> None:
    _, k0, k1, p, gstrides, starts, indices, stream, hstrides = inputs
    ctx.args = (k0, k1, p, list(gstrides), list(starts), stream, list(hstrides))
    ctx.has_index = [index is not None for index in indices]
    ctx.save_for_backward(*(index for index in indices if index is not None))


def _backward(ctx, grad: torch.Tensor):
    saved = iter(ctx.saved_tensors)
    indices: list[Optional[torch.Tensor]] = [next(saved) if has else None for has in ctx.has_index]
    k0, k1, p, gstrides, starts, stream, hstrides = ctx.args
    return (dropout(grad, k0, k1, p, gstrides, starts, indices, stream, hstrides),) + (None,) * 8


dropout.register_autograd(_backward, setup_context=_setup_context)


class _EagerDropout(torch.autograd.Function):
    """The op's eager form: the same kernels and values without the custom-op machinery.

    ``torch.library.custom_op`` routes every eager call and its backward through
    Python argument binding, pytree flattening and a redispatch; for the many small
    dropout calls of a keyed forward that costs more than the kernel. The geometry
    is planned once and reused by the backward (the same op on the gradient).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, geometry: Geometry) -> torch.Tensor:
        # the index vectors (if any) are saved as tensors, the rest of the geometry is a few ints
        indices = geometry.indices
        for index in indices:
            if index is not None:
                ctx.has_index = [i is not None for i in indices]
                ctx.geometry = attrs.evolve(geometry, indices=tuple(None for _ in indices))
                ctx.save_for_backward(*(i for i in indices if i is not None))
                return dispatch.dropout(x, geometry)
        ctx.has_index = None
        ctx.geometry = geometry  # nothing to save: the backward's geometry is this one
        return dispatch.dropout(x, geometry)  # (run's call, without its frame: every dropout of a forward)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.has_index is None:
            if not _grad_enabled():  # no double backward: the op itself, without recording it
                return dispatch.dropout(grad, ctx.geometry), None
            return _EagerDropout.apply(grad, ctx.geometry), None
        saved = iter(ctx.saved_tensors)
        indices = tuple(next(saved) if has else None for has in ctx.has_index)
        return _EagerDropout.apply(grad, attrs.evolve(ctx.geometry, indices=indices)), None


# ``_EagerDropout.apply`` without ``torch.autograd.Function.apply``'s Python wrapper, for calls outside any
# functorch transform: what that wrapper does there (its default-argument binding only applies to a
# Function with a ``setup_context``, which this one has not), with the dead-wrapper check on the input.
_apply = super(torch.autograd.Function, _EagerDropout).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def call(x: torch.Tensor, k0: int, k1: int, p: float, gstrides: Sequence[int], starts: Sequence[int],
         indices: Sequence[Optional[torch.Tensor]], stream: str = DEFAULT_STREAM,
         hstrides: Sequence[int] = ()) -> torch.Tensor:
    """``keyinit::dropout`` on ``x``: the eager form for plain CPU/CUDA tensors, the custom op otherwise.

    The custom op (with its fake kernel) is what ``torch.compile`` traces and what
    fake/meta tensors and tensor subclasses take; both give the same values.
    """
    if type(x) is torch.Tensor and not _is_compiling():
        device = x.device.type
        if device == "cpu" or device == "cuda":
            return _eager(x, plan(x.shape, k0, k1, p, gstrides, starts, indices, stream, hstrides))
    # (all-zero high strides for none: an empty list would be a node of its own in autograd's input structure)
    return dropout(x, k0, k1, p, list(gstrides), list(starts), list(indices), stream,
                   list(hstrides) or [0] * len(gstrides))


def call_rows(x: torch.Tensor, p: float, key: Key, row_offset: int) -> torch.Tensor:
    """:func:`call` of ``x`` laid out by :func:`keyinit._draw.dropout_geometry.rows_layout` (row ``r`` is
    global sample ``row_offset + r``) under ``key``: keyed() dropout of an activation whose batch is its
    dimension 0, planned from a memo of its shape."""
    if type(x) is torch.Tensor and not _is_compiling():
        device = x.device.type
        if device == "cpu" or device == "cuda":
            return _eager(x, with_key(rows_template(x.shape, row_offset, p, key.stream), key.k0, key.k1))
    layout = rows_layout(tuple(x.shape), row_offset, key.stream)
    return call(x, key.k0, key.k1, p, layout.gstrides, layout.starts, layout.indices, key.stream, layout.hstrides)


def _eager(x: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """The eager form on a plain tensor: the op alone where there is no backward to plan for (eval, a
    compiled site), else the autograd function; under a torch.func transform, :func:`_under_functorch`."""
    if _wrapped(x):
        return _under_functorch(x, geometry)
    if not (x.requires_grad and _grad_enabled()):
        return dispatch.dropout(x, geometry)
    if _functorch_active():
        return _EagerDropout.apply(x, geometry)
    return _apply(_unwrap_if_dead(x), geometry)


def _under_functorch(x: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """The op on a tensor of a ``torch.func`` transform (grad, vjp, jacrev): the keep mask made outside the
    transform (the op on a tensor of ones), applied by torch ops with docs/spec.md 14.3's arithmetic, so every
    transform (the vmap of jacrev's backward too) differentiates and batches it as torch's own ops."""
    from keyinit._draw.reference_dropout import apply_mask

    with torch._C._DisableFuncTorch(), torch._C.DisableTorchFunction():
        keep = dispatch.dropout(torch.ones(x.shape, dtype=x.dtype, device=x.device), geometry) != 0
    return apply_mask(x, keep, geometry.scale32, geometry.scale64)
