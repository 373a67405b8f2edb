"""Keyed attention dropout: scaled dot-product attention whose probability dropout is keyed.

``attend(q, k, v, attn_mask, p, is_causal, scale, enable_gqa, drop, positions)``
computes ``softmax(q k^T * scale + mask) -> drop -> @ v`` with torch's own matmul
and softmax, and the dropout of the attention probabilities ``(..., Lq, Lk)``
done by ``drop`` (the ``keyinit::dropout`` op: its backward regenerates the mask
from the key and saves nothing of the probabilities' size). The keep-mask of
probability ``(b, h, i, j)`` is therefore ``bernoulli(K, (B, H, Lq, Lk), 1 - p)``
at its GLOBAL index: exactly the mask that a separate ``F.dropout`` of the
probabilities (HF's eager attention) draws under the same key
(``docs/spec.md`` section 14.5).

:func:`mha_forward` is ``F.multi_head_attention_forward`` for the training path
with the attention computed by a given ``attend``; :func:`keyinit.nn.keyed`
answers ``nn.MultiheadAttention`` (and so the ``nn.Transformer*Layer`` family)
with it, because torch's own function hides its inner SDPA call from a
``TorchFunctionMode``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["attend", "mha_forward"]

Drop = Callable[[torch.Tensor], torch.Tensor]


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from keyinit.layouts import dtensor_class as _dtensor_class

    cls = _dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def _positions(n: int, start: int, index: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    if index is not None:
        return index.to(device)
    return torch.arange(start, start + n, device=device)


class _DropThenMatmul(torch.autograd.Function):
    """``drop(P) @ v`` saving only ``P`` (which softmax saves anyway) and ``v``: the dropped ``P`` is regenerated.

    Dropout is diagonal, so ``dP = drop(dOut @ v^T)`` and ``dv = drop(P)^T @ dOut``
    with ``drop`` regenerating the mask from the key: nothing mask-sized and no
    second probability matrix is kept for backward.
    """

    @staticmethod
    def forward(ctx, probs: torch.Tensor, value: torch.Tensor, drop: Drop) -> torch.Tensor:
        ctx.drop = drop
        ctx.save_for_backward(probs, value)
        return torch.matmul(drop(probs), value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, value = ctx.saved_tensors
        drop = ctx.drop
        grad_probs = grad_value = None
        # Under autocast the forward's matmul ran in the autocast dtype (the output's, so grad's): the backward's
        # matmuls do too, and each gradient is returned in its input's dtype (no-ops when the dtypes agree).
        if ctx.needs_input_grad[0]:
            grad_probs = drop(torch.matmul(grad, value.to(grad.dtype).transpose(-2, -1)).to(probs.dtype))
        if ctx.needs_input_grad[1]:
            grad_value = torch.matmul(drop(probs).to(grad.dtype).transpose(-2, -1), grad).to(value.dtype)
            if grad_value.shape != value.shape:  # value broadcast over leading dimensions
                grad_value = grad_value.sum_to_size(value.shape)
        return grad_probs, grad_value, None


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
    drop: Optional[Drop],
    positions: Optional[tuple[int, Optional[torch.Tensor], int, Optional[torch.Tensor]]] = None,
    need_weights: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(output, dropped probabilities or None)`` of scaled dot-product attention (torch's SDPA semantics).

    ``positions = (q_start, q_index, k_start, k_index)`` are the global query and
    key positions that ``is_causal`` compares (default: local, from 0);
    ``drop=None`` applies no dropout. On the CPU, 16-bit inputs are computed in
    float32 (as torch's CPU SDPA does) and the output is rounded back.
    """
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            f"scaled_dot_product_attention: query, key and value must have the same number (>= 2) of dimensions, "
            f"got {query.dim()}, {key.dim()} and {value.dim()}"
        )
    if query.is_nested or key.is_nested or value.is_nested:
        raise TypeError("scaled_dot_product_attention: nested tensors are not supported with keyed dropout")
    if enable_gqa and query.dim() >= 3 and key.size(-3) != query.size(-3):
        groups = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    out_dtype = query.dtype
    if query.device.type == "cpu" and out_dtype in (torch.float16, torch.bfloat16):
        query, key, value = query.float(), key.float(), value.float()
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.float()
    length, source = query.size(-2), key.size(-2)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else float(scale)
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        if attn_mask is not None:
            raise RuntimeError("scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both")
        q_start, q_index, k_start, k_index = positions if positions is not None else (0, None, 0, None)
        qpos = _positions(length, q_start, q_index, scores.device)
        kpos = _positions(source, k_start, k_index, scores.device)
        attn_mask = qpos[:, None] >= kpos[None, :]
    if attn_mask is not None and _is_dtensor(scores) and not _is_dtensor(attn_mask):
        # a DTensor's sizes are global: the mask is the global one, replicated (its ops shard it as needed)
        from torch.distributed.tensor import DTensor, Replicate

        mesh = scores.device_mesh
        attn_mask = DTensor.from_local(attn_mask, mesh, [Replicate()] * mesh.ndim, run_check=False)
    masked_rows = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
        # a row with every key masked gets probabilities 0 (torch's SDPA does the same), not NaN; its
        # scores are replaced before the softmax so that no NaN reaches the backward either
        masked_rows = torch.isneginf(scores).all(dim=-1, keepdim=True)
        scores = scores.masked_fill(masked_rows, 0.0)
    if scores.dtype in (torch.float16, torch.bfloat16):
        probs = torch.softmax(scores.float(), dim=-1).to(scores.dtype)
    else:
        probs = torch.softmax(scores, dim=-1)
    if masked_rows is not None:
        probs = probs.masked_fill(masked_rows, 0.0)
    if drop is None:
        out = torch.matmul(probs, value)
    elif need_weights:
        probs = drop(probs)
        out = torch.matmul(probs, value)
    else:
        out = _DropThenMatmul.apply(probs, value, drop)
    weights = probs.to(out_dtype) if need_weights else None
    return out.to(out_dtype), weights


# ----------------------------------------------------------------------------- nn.MultiheadAttention

_MHA_ARGS = (
    "query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias", "bias_k",
    "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training", "key_padding_mask",
    "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
    "static_k", "static_v", "average_attn_weights", "is_causal",
)
_MHA_DEFAULTS = {
    "training": True, "key_padding_mask": None, "need_weights": True, "attn_mask": None,
    "use_separate_proj_weight": False, "q_proj_weight": None, "k_proj_weight": None, "v_proj_weight": None,
    "static_k": None, "static_v": None, "average_attn_weights": True, "is_causal": False,
}


def mha_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """``F.multi_head_attention_forward``'s arguments by name."""
    bound = dict(_MHA_DEFAULTS)
    bound.update(zip(_MHA_ARGS, args))
    bound.update(kwargs)
    missing = [name for name in _MHA_ARGS if name not in bound]
    if missing:
        raise TypeError(f"multi_head_attention_forward: missing arguments {missing}")
    return bound


def mha_forward(a: dict[str, Any], drop: Drop) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``F.multi_head_attention_forward(**a)`` in training with ``dropout_p > 0``, the dropout done by ``drop``.

    ``drop`` receives the attention probabilities shaped ``(batch, heads, Lq, Lk)``.
    """
    for name in ("bias_k", "bias_v", "static_k", "static_v"):
        if a[name] is not None:
            raise TypeError(f"nn.MultiheadAttention with {name} is not supported with keyed attention dropout")
    if a["add_zero_attn"]:
        raise TypeError("nn.MultiheadAttention with add_zero_attn=True is not supported with keyed attention dropout")
    query, key, value = a["query"], a["key"], a["value"]
    num_heads = a["num_heads"]
    key_padding_mask, attn_mask, is_causal = a["key_padding_mask"], a["attn_mask"], a["is_causal"]
    is_batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
    if not is_batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    if embed_dim != a["embed_dim_to_check"]:
        raise AssertionError(f"was expecting embedding dimension of {a['embed_dim_to_check']}, but got {embed_dim}")
    head_dim = embed_dim // num_heads
    key_padding_mask = F._canonical_mask(
        mask=key_padding_mask, mask_name="key_padding_mask", other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask", target_type=query.dtype,
    )
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not a["need_weights"]:
        attn_mask = None
    else:
        attn_mask = F._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="", target_type=query.dtype,
            check_other=False,
        )
        is_causal = False
    if not a["use_separate_proj_weight"]:
        q, k, v = F._in_projection_packed(query, key, value, a["in_proj_weight"], a["in_proj_bias"])
    else:
        bias = a["in_proj_bias"]
        b_q, b_k, b_v = (None, None, None) if bias is None else bias.chunk(3)
        q, k, v = F._in_projection(
            query, key, value, a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"], b_q, b_k, b_v
        )
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    q = q.view(tgt_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)
    k = k.view(src_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)
    v = v.view(src_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)
    if attn_mask is not None:
        attn_mask = attn_mask.view(1, 1, tgt_len, src_len) if attn_mask.size(0) == 1 else attn_mask.view(
            bsz, num_heads, tgt_len, src_len)
    if key_padding_mask is not None:
        padding = key_padding_mask.view(bsz, 1, 1, src_len)
        attn_mask = padding if attn_mask is None else attn_mask + padding
    out, weights = attend(q, k, v, attn_mask, is_causal, None, False, drop, need_weights=a["need_weights"])
    out = out.permute(2, 0, 1, 3).reshape(tgt_len * bsz, embed_dim)
    out = F.linear(out, a["out_proj_weight"], a["out_proj_bias"]).view(tgt_len, bsz, embed_dim)
    if a["need_weights"]:
        if a["average_attn_weights"]:
            weights = weights.mean(dim=1)
        if not is_batched:
            out, weights = out.squeeze(1), weights.squeeze(0)
        return out, weights
    if not is_batched:
        out = out.squeeze(1)
    return out, None
