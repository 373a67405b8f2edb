"""Module rules that reproduce torch.nn's own default initialization.

:data:`DEFAULT_RULES` maps ``torch.nn`` module types to module rules (see
:mod:`keyinit.rules`) that give every parameter and buffer the same
distribution as the module's ``reset_parameters`` in torch 2.13 (same family,
same parameters; the values come from the keyed stream, not torch's RNG).
Fans are taken from the GLOBAL weight shape (``ctx.global_shape("weight")``),
so a sharded module gets the bounds of the whole weight.

A rule returns initializers only for the tensors the module has (``bias=False``,
``affine=False``, ``elementwise_affine=False`` and ``track_running_stats=False``
drop entries), and only for the module's own (direct) tensors.

``nn.MultiheadAttention``: torch's ``_reset_parameters`` also zeroes its
child ``out_proj.bias`` (a ``NonDynamicallyQuantizableLinear``, whose weight
keeps ``nn.Linear``'s default). Rules only name a module's own tensors, so the
child's rule does it: :data:`DEFAULT_RULES` maps
``NonDynamicallyQuantizableLinear`` (in torch used only as
``MultiheadAttention.out_proj``) to :func:`mha_out_proj` (Linear's weight
init, zero bias).

``nn.Transformer``'s ``_reset_parameters`` re-initializes every >1-D parameter
of all its descendants with ``xavier_uniform_``, which a per-module rule (a
module's own tensors only) cannot say. :data:`DEFAULT_INIT_CODE` holds such
built-in init code: keyinit captures it like a module's ``reset_parameters``,
on top of its descendants' defaults, so an ``nn.Transformer`` gets
``xavier_uniform()`` on every >1-D parameter and its layers' defaults on the rest.
"""

from __future__ import annotations

import math

from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from keyinit.init import (
    Initializer,
    calculate_fan_in_and_fan_out,
    kaiming_uniform,
    normal,
    ones,
    uniform,
    with_zero_rows,
    xavier_normal,
    xavier_uniform,
    zeros,
)
from keyinit.rules import ModuleRule, RuleContext

__all__ = [
    "DEFAULT_RULES",
    "DEFAULT_INIT_CODE",
    "linear",
    "bilinear",
    "conv",
    "embedding",
    "layer_norm",
    "rms_norm",
    "group_norm",
    "batch_norm",
    "multihead_attention",
    "mha_out_proj",
]

Fills = dict[str, Initializer]

_SQRT5 = math.sqrt(5)


def _has(module: nn.Module, name: str) -> bool:
    return getattr(module, name, None) is not None


def _weight_default() -> Initializer:
    """``kaiming_uniform_(weight, a=sqrt(5))``: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
    return kaiming_uniform(a=_SQRT5)


def _fan_in_bias(ctx: RuleContext) -> Initializer:
    """torch's bias default: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, fan_in of the GLOBAL weight; 0 if fan_in is 0."""
    fan_in, _ = calculate_fan_in_and_fan_out(ctx.global_shape("weight"))
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    return uniform(-bound, bound)


def linear(module: nn.Module, ctx: RuleContext) -> Fills:
    """``nn.Linear``: weight ``kaiming_uniform(a=sqrt(5))``, bias ``U(+-1/sqrt(in_features))``."""
    plan: Fills = {"weight": _weight_default()}
    if _has(module, "bias"):
        plan["bias"] = _fan_in_bias(ctx)
    return plan


def mha_out_proj(module: nn.Module, ctx: RuleContext) -> Fills:
    """``MultiheadAttention.out_proj``: Linear's weight default, bias zeros (set by the MHA in torch)."""
    plan: Fills = {"weight": _weight_default()}
    if _has(module, "bias"):
        plan["bias"] = zeros()
    return plan


def bilinear(module: nn.Module, ctx: RuleContext) -> Fills:
    """``nn.Bilinear``: weight and bias ``U(+-1/sqrt(in1_features))``, ``in1_features = weight.shape[1]``."""
    in1 = ctx.global_shape("weight")[1]
    if in1 <= 0:
        raise ValueError(f"{ctx.fqn('weight')}: in1_features must be > 0, but got (in1_features={in1})")
    bound = 1 / math.sqrt(in1)
    plan: Fills = {"weight": uniform(-bound, bound)}
    if _has(module, "bias"):
        plan["bias"] = uniform(-bound, bound)
    return plan


def conv(module: nn.Module, ctx: RuleContext) -> Fills:
    """``nn.Conv{1,2,3}d`` and ``nn.ConvTranspose{1,2,3}d``: as :func:`linear`, with torch's fans.

    The weight is ``(out, in/groups, *k)`` (``(in, out/groups, *k)`` when
    transposed), and torch takes ``fan_in = shape[1] * prod(k)`` in both cases;
    so do these rules, from the global weight shape.
    """
    return linear(module, ctx)


def embedding(module: nn.Module, ctx: RuleContext) -> Fills:
    """``nn.Embedding``/``nn.EmbeddingBag``: weight ``N(0, 1)``, row ``padding_idx`` zero."""
    padding_idx = getattr(module, "padding_idx", None)
    if padding_idx is None:
        return {"weight": normal()}
    return {"weight": with_zero_rows(normal(), padding_idx)}


def _affine(module: nn.Module, plan: Fills) -> Fills:
    if _has(module, "weight"):
        plan["weight"] = ones()
    if _has(module, "bias"):
        plan["bias"] = zeros()
    return plan


def layer_norm(module: nn.Module, ctx: RuleContext) -> Fills:
    """``nn.LayerNorm``: weight ones, bias zeros (when ``elementwise_affine``; bias when ``bias=True``)."""
    return _affine(module, {})


def rms_norm(module: nn.Module, ctx: RuleContext) -> Fills:
    """``nn.RMSNorm``: weight ones (when ``elementwise_affine``)."""
    return _affine(module, {})


def group_norm(module: nn.Module, ctx: RuleContext) -> Fills:
    """``nn.GroupNorm``: weight ones, bias zeros (when ``affine``)."""
    return _affine(module, {})


def batch_norm(module: nn.Module, ctx: RuleContext) -> Fills:
    """``nn.BatchNorm{1,2,3}d``, ``nn.SyncBatchNorm``, ``nn.InstanceNorm{1,2,3}d``.

    As ``_NormBase.reset_parameters``: when ``track_running_stats``,
    ``running_mean`` zeros, ``running_var`` ones, ``num_batches_tracked`` zeros
    (buffers); when ``affine``, weight ones and bias zeros.
    """
    plan: Fills = {}
    if _has(module, "running_mean"):
        plan["running_mean"] = zeros()
    if _has(module, "running_var"):
        plan["running_var"] = ones()
    if _has(module, "num_batches_tracked"):
        plan["num_batches_tracked"] = zeros()
    return _affine(module, plan)


def multihead_attention(module: nn.Module, ctx: RuleContext) -> Fills:
    """``nn.MultiheadAttention``, as its ``_reset_parameters``.

    ``in_proj_weight`` (or ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``
    when the key/value dims differ) ``xavier_uniform()``; ``in_proj_bias``
    zeros; ``bias_k``/``bias_v`` (``add_bias_kv``) ``xavier_normal()``.
    ``out_proj`` is a child module: see :func:`mha_out_proj`.
    """
    plan: Fills = {}
    for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
        if _has(module, name):
            plan[name] = xavier_uniform()
    if _has(module, "in_proj_bias"):
        plan["in_proj_bias"] = zeros()
    for name in ("bias_k", "bias_v"):
        if _has(module, name):
            plan[name] = xavier_normal()
    return plan


#: torch.nn module type -> rule reproducing its torch 2.13 default initialization.
DEFAULT_RULES: dict[type[nn.Module], ModuleRule] = {
    nn.Linear: linear,
    NonDynamicallyQuantizableLinear: mha_out_proj,
    nn.Bilinear: bilinear,
    nn.Conv1d: conv,
    nn.Conv2d: conv,
    nn.Conv3d: conv,
    nn.ConvTranspose1d: conv,
    nn.ConvTranspose2d: conv,
    nn.ConvTranspose3d: conv,
    nn.Embedding: embedding,
    nn.EmbeddingBag: embedding,
    nn.LayerNorm: layer_norm,
    nn.RMSNorm: rms_norm,
    nn.GroupNorm: group_norm,
    nn.BatchNorm1d: batch_norm,
    nn.BatchNorm2d: batch_norm,
    nn.BatchNorm3d: batch_norm,
    nn.SyncBatchNorm: batch_norm,
    nn.InstanceNorm1d: batch_norm,
    nn.InstanceNorm2d: batch_norm,
    nn.InstanceNorm3d: batch_norm,
    nn.MultiheadAttention: multihead_attention,
}


def transformer_reset(module: nn.Module) -> None:
    """``nn.Transformer``: its own ``_reset_parameters`` (``xavier_uniform_`` on every >1-D parameter)."""
    module._reset_parameters()


#: torch.nn module type -> built-in init code that spans its descendants (captured, lowest precedence
#: after the per-module defaults).
DEFAULT_INIT_CODE: dict[type[nn.Module], "object"] = {
    nn.Transformer: transformer_reset,
}
