"""Keyed stochastic rounding of activations and gradients inside a keyed forward: per sample, like dropout.

:func:`stochastic_round` rounds an activation with the rounding rule of ``docs/spec.md`` 17.2, its
random word per element being the value of ``torch.randint_like(x, 0, 2**32)``, which ``keyed()``
keys by (seed, step, module FQN, call ordinal, the element's sample and place) (14.7);
:func:`stochastic_round_grad` is the identity in the forward and rounds the gradient in the backward,
by words of a per-sample key that the forward draws the same way (``docs/spec.md`` 17.8). Both refuse
to run outside a keyed forward (an explicit key: :func:`keyinit.random.stochastic_round`).
"""

from __future__ import annotations

from typing import Any

import torch

from keyinit._bits.philox import stream_words
from keyinit._bits.sround import TARGETS, check_round_input, round_bits, to_dtype
from keyinit.errors import UnkeyedRandomnessError

__all__ = ["stochastic_round", "stochastic_round_grad"]

_SOURCES = (torch.float32, torch.float64)


def _check(name: str, x: Any, dtype: Any) -> None:
    check_round_input(f"keyinit.nn.{name}", x, dtype)
    from keyinit.nn._context.keyed import inside_keyed_forward

    if not inside_keyed_forward():
        raise UnkeyedRandomnessError(
            f"keyinit.nn.{name} ran outside a keyinit.nn.keyed forward; it never draws unkeyed rounding bits. "
            "Call it inside the forward of a module of a model run under `with keyinit.nn.keyed(model, seed, "
            "step=step, sample_offset=...)`, or round under an explicit key with "
            "keyinit.random.stochastic_round(key, x, dtype).")


def _rounded(x: torch.Tensor, words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to ``dtype`` by docs/spec.md 17.2 with one word (int64 in ``[0, 2**32)``) per element."""
    flat = x.detach().contiguous().reshape(-1)
    return to_dtype(round_bits(flat, words.reshape(-1), TARGETS[dtype]), dtype).reshape(x.shape)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (float32 or float64) rounded stochastically to ``dtype`` (bfloat16, float16, float8_e5m2,
    float8_e4m3fn) inside a keyed forward, per sample like dropout (``docs/spec.md`` 17.8).

    Element ``e``'s word is ``torch.randint_like(x, 0, 2**32, dtype=torch.int64)[e]``, which ``keyed()``
    keys by (seed, step, the calling module's FQN, the call's ordinal, ``e``'s global sample and its
    place in the sample) (14.7; the op takes one call ordinal); the rounding is 17.2's with that word.
    So a batch split into rows (data-parallel ranks, micro-batches) rounds each row as the whole batch
    does. Returns a new ``dtype`` tensor of ``x``'s shape, with no gradient (for a straight-through
    gradient: ``x + (stochastic_round(x, dtype).to(x.dtype) - x).detach()``). Outside a keyed forward:
    :class:`keyinit.errors.UnkeyedRandomnessError`.
    """
    _check("stochastic_round", x, dtype)
    words = torch.randint_like(x.detach(), 0, 1 << 32, dtype=torch.int64)
    return _rounded(x, words, dtype)


class _RoundGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(keys)
        ctx.dtype = dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (keys,) = ctx.saved_tensors
        rows = grad.shape[0]
        grad32 = grad if grad.dtype in _SOURCES else grad.float()
        within = torch.arange(grad32[0].numel(), dtype=torch.int64, device=grad.device)
        index = within.unsqueeze(0).expand(rows, -1)
        (words,) = stream_words((keys[:, :1], keys[:, 1:]), index, 1)
        rounded = _rounded(grad32, words, ctx.dtype).to(grad.dtype)
        return rounded, None, None


def stochastic_round_grad(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The identity on ``x`` (float32 or float64, dimension 0 its batch) whose gradient is rounded
    stochastically to ``dtype`` and returned in ``x``'s dtype (quantize-dequantize of the backward),
    keyed per sample (``docs/spec.md`` 17.8).

    The forward draws each row's key, ``torch.randint_like(r, 0, 2**32, dtype=torch.int64)`` with
    ``r`` of shape ``(rows, 2)`` holding ``x``'s rows (keyed per sample by ``keyed()``, 14.7); the
    backward rounds element ``j`` (row-major within its row) of row ``s``'s gradient with stream word
    ``j`` of the key ``(k0, k1)`` of row ``s`` (section 4), by 17.2. Only ``(rows, 2)`` int64 is kept for the backward;
    the backward may run inside or outside the keyed block. Outside a keyed forward:
    :class:`keyinit.errors.UnkeyedRandomnessError`.
    """
    _check("stochastic_round_grad", x, dtype)
    if x.dim() == 0 or x[0].numel() == 0:
        raise ValueError(f"keyinit.nn.stochastic_round_grad: x must have a batch dimension 0 and elements in each "
                         f"row, got shape {tuple(x.shape)}")
    rows = x.detach().reshape(x.shape[0], -1)[:, :1].expand(-1, 2)
    keys = torch.randint_like(rows, 0, 1 << 32, dtype=torch.int64)
    return _RoundGrad.apply(x, keys, dtype)
