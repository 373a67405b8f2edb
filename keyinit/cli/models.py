"""Small models for ``keyinit demo``, the examples (``examples/models.py``) and the tests.

* :class:`Transformer`: a Llama-like decoder (token embedding, RMSNorm,
  grouped-query attention with ``wq/wk/wv/wo``, SwiGLU feed-forward with
  ``w1/w2/w3``, output projection), laid out with torchtitan's FQNs
  (``tok_embeddings``, ``layers.<i>.attention.wq``, ``layers.<i>.feed_forward.w1``,
  ``norm``, ``output``). ``layers`` is an ``nn.ModuleDict`` keyed by the layer
  index, so a pipeline stage can delete the layers it does not own and keep
  the original FQNs.
* :class:`ConvNet`: a small CNN (Conv2d, BatchNorm2d, Linear head).

Both are meta-device friendly: their constructors create only parameters (no
buffers computed from data, no random draws of their own), so
``with torch.device("meta"): model = Transformer(args)`` allocates nothing.
RoPE is computed in ``forward``. The models have no init code of their own:
``keyinit`` gives them torch.nn's default distributions (``nn.Linear``'s
kaiming-uniform, ``nn.Embedding``'s normal, ...) or the Llama-style rules of
:func:`llama_rules`.

``model_size`` picks a preset: ``tiny`` (tests and the CLI demo), ``small``,
``medium``, ``large``, ``llama3-8b`` (only sensible on the meta device).
Sizes are chosen so that most dimensions do NOT divide evenly by 2, 4 or 8,
so sharding them exercises uneven shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ModelArgs",
    "SIZES",
    "Transformer",
    "TransformerBlock",
    "Attention",
    "FeedForward",
    "ConvNet",
    "llama",
    "llama_rules",
    "convnet",
    "TP_ROWWISE",
    "tp_plan",
    "pipeline_stage",
]


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = 2
    vocab_size: int = 97
    ffn_hidden: int = 86
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


#: Presets for ``model_size``. Odd vocab / FFN sizes make shards uneven.
SIZES: dict[str, ModelArgs] = {
    "tiny": ModelArgs(),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=4099, ffn_hidden=690),
    "medium": ModelArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=16411, ffn_hidden=1382),
    "large": ModelArgs(dim=1024, n_layers=12, n_heads=16, n_kv_heads=8, vocab_size=32003, ffn_hidden=2762),
    "llama3-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336),
}

#: Linear layers that tensor parallelism shards row-wise (weight ``Shard(1)``); all others column-wise.
TP_ROWWISE = ("wo", "w2")


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` shaped (batch, seq, heads, head_dim)."""
    seq, head_dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.rope_theta = args.rope_theta
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # Head counts come from the projections' (possibly tensor-parallel, local) outputs.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = _rope(q, self.rope_theta), _rope(k, self.rope_theta)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """A Llama-like decoder. Pipeline stages set ``tok_embeddings``/``norm``/``output`` to None."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def llama(model_size: str = "tiny", **overrides) -> Transformer:
    """``Transformer(SIZES[model_size])`` with field overrides (``llama("tiny", n_layers=4)``)."""
    if model_size not in SIZES:
        raise ValueError(f"unknown model_size {model_size!r}; choose one of {sorted(SIZES)}")
    return Transformer(replace(SIZES[model_size], **overrides))


def llama_rules(args: ModelArgs) -> dict:
    """Llama-style init as keyinit FQN rules (torchtitan's distributions, depth-scaled by layer count).

    Norm weights keep nn.RMSNorm's default (ones). With ``tie_embeddings`` the
    output shares the embedding's tensor, so it has no rule of its own.
    """
    from keyinit import init

    depth_std = 0.02 / math.sqrt(2 * args.n_layers)
    rules = {
        "tok_embeddings.weight": init.normal(std=1.0),
        "layers.*.attention.w[qkv].weight": init.truncated_normal(std=0.02),
        "layers.*.attention.wo.weight": init.truncated_normal(std=depth_std),
        "layers.*.feed_forward.w1.weight": init.truncated_normal(std=0.02),
        "layers.*.feed_forward.w[23].weight": init.truncated_normal(std=depth_std),
    }
    if not args.tie_embeddings:
        out_std = args.dim ** -0.5
        rules["output.weight"] = init.truncated_normal(std=out_std, a=-3 * out_std, b=3 * out_std)
    return rules


class ConvNet(nn.Module):
    """A small CNN: two conv blocks (Conv2d + BatchNorm2d) and a Linear head. ``width`` scales channels."""

    def __init__(self, width: int = 8, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


_CONV_WIDTHS = {"tiny": 8, "small": 32, "medium": 128, "large": 256}


def convnet(model_size: str = "tiny") -> ConvNet:
    if model_size not in _CONV_WIDTHS:
        raise ValueError(f"unknown model_size {model_size!r}; choose one of {sorted(_CONV_WIDTHS)}")
    return ConvNet(width=_CONV_WIDTHS[model_size] + 1)  # odd widths: uneven shards


def tp_plan(model: Transformer) -> dict:
    """torchtitan's tensor-parallel plan for :class:`Transformer` (no sequence parallelism).

    ``wq/wk/wv/w1/w3`` and ``output`` column-wise (weight ``Shard(0)``),
    ``wo/w2`` row-wise (weight ``Shard(1)``), ``tok_embeddings`` row-wise
    (vocab-sharded, ``Shard(0)``). Norms stay replicated.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    for name in model.layers:
        for leaf in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{name}.{leaf}"] = ColwiseParallel()
        for leaf in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{name}.{leaf}"] = RowwiseParallel()
    return plan


def pipeline_stage(model: Transformer, stage: int, num_stages: int) -> Transformer:
    """Cut ``model`` in place to pipeline stage ``stage`` of ``num_stages``, torchtitan style.

    The stage keeps the original FQNs: it deletes the layers it does not own
    from the ``layers`` ModuleDict and sets ``tok_embeddings`` (all but the
    first stage) and ``norm``/``output`` (all but the last) to None. Layers are
    split into contiguous, near-equal runs.
    """
    from keyinit.walk import stage_blocks

    names = list(model.layers)
    owned = set(stage_blocks(names, num_stages)[stage])
    for name in names:
        if name not in owned:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != num_stages - 1:
        model.norm = None
        model.output = None
    return model
