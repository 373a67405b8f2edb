"""A torchtitan-style decoder written for the tests (no torchtitan dependency).

It follows the init code patterns of torchtitan 0.3.0 that issue 8 lists
(``shared/REFERENCE.md``: "Facts gathered for issues 6-8"):

- a fused QKV projection (``attention.wqkv``) whose ``init_weights`` draws q, k and v
  on TEMPORARIES, ``trunc_normal_`` in the Llama3 flavour and ``normal_`` in the
  Qwen3-MoE flavour, then ``cat`` + ``copy_`` into the fused weight;
- a complex RoPE cache (``freqs_cis``) that the root's ``init_weights`` re-creates by
  assignment under ``with torch.device(buffer_device)``;
- MoE buffers (``expert_bias``, ``tokens_per_expert``) re-created by assignment in
  the MoE's ``init_weights``;
- ``init_weights(buffer_device=...)``: a root-level method that walks its layers;
- pipeline stages that keep the full model's FQNs: the ``layers`` ModuleDict keeps its
  keys, absent modules are ``None``, and ``init_weights`` skips them.

Sizes are odd so FSDP2 over 4 ranks and TP over 2 shard unevenly (vocab 67, FFN 37,
fused QKV 30 rows, 3 experts).
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch
from torch import nn

__all__ = ["TitanArgs", "Transformer", "build", "pipeline_stage", "tp_plan", "fsdp_wrap", "FLAVOURS"]

FLAVOURS = ("llama3", "qwen3_moe")


@attrs.frozen
class TitanArgs:
    flavour: str = attrs.field(validator=attrs.validators.in_(FLAVOURS))
    dim: int = 18
    n_layers: int = 4
    n_heads: int = 3
    n_kv_heads: int = 1
    vocab_size: int = 67
    ffn_hidden: int = 37
    moe_hidden: int = 13
    num_experts: int = 3
    max_seq_len: int = 16
    rope_theta: float = 10000.0
    depth_init: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    """``exp(i * t * theta^(-2j/head_dim))`` for positions ``t < end``, as complex64 ``(end, head_dim // 2)``."""
    exponents = torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    positions = torch.arange(end, device=inv_freq.device).float()
    angles = torch.outer(positions, inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


class FusedQKVAttention(nn.Module):
    def __init__(self, args: TitanArgs) -> None:
        super().__init__()
        self.flavour = args.flavour
        self.q_rows = args.n_heads * args.head_dim
        self.kv_rows = args.n_kv_heads * args.head_dim
        self.wqkv = nn.Linear(args.dim, self.q_rows + 2 * self.kv_rows, bias=False)
        self.wo = nn.Linear(self.q_rows, args.dim, bias=False)
        if args.flavour == "qwen3_moe":
            self.q_norm: Optional[nn.RMSNorm] = nn.RMSNorm(args.head_dim)
            self.k_norm: Optional[nn.RMSNorm] = nn.RMSNorm(args.head_dim)
        else:
            self.q_norm = self.k_norm = None

    def init_weights(self, init_std: float) -> None:
        weight = self.wqkv.weight
        parts = []
        for rows in (self.q_rows, self.kv_rows, self.kv_rows):
            part = torch.empty(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            if self.flavour == "llama3":
                nn.init.trunc_normal_(part, mean=0.0, std=0.02)
            else:
                nn.init.normal_(part, mean=0.0, std=0.02)
            parts.append(part)
        with torch.no_grad():
            weight.copy_(torch.cat(parts, dim=0))
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)


class MoE(nn.Module):
    def __init__(self, args: TitanArgs) -> None:
        super().__init__()
        self.experts = GroupedExperts(args.dim, args.moe_hidden, args.num_experts)
        self.router = nn.Linear(args.dim, args.num_experts, bias=False)
        self.shared_expert = FeedForward(args.dim, args.moe_hidden)
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.float32),
                             persistent=False)

    def init_weights(self, init_std: float, buffer_device: torch.device) -> None:
        self.experts.init_weights(init_std)
        nn.init.trunc_normal_(self.router.weight, mean=0.0, std=init_std)
        self.shared_expert.init_weights(init_std)
        with torch.device(buffer_device):
            self.expert_bias = torch.zeros(self.experts.num_experts, dtype=torch.float32)
            self.tokens_per_expert = torch.zeros(self.experts.num_experts, dtype=torch.float32)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: TitanArgs) -> None:
        super().__init__()
        self.attention = FusedQKVAttention(args)
        self.moe_enabled = args.flavour == "qwen3_moe"
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        self.attention_norm = nn.RMSNorm(args.dim)
        self.ffn_norm = nn.RMSNorm(args.dim)
        layers = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * layers) ** 0.5

    def init_weights(self, buffer_device: torch.device) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        if self.moe_enabled:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.weight_init_std)


class Transformer(nn.Module):
    def __init__(self, args: TitanArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: Optional[nn.RMSNorm] = nn.RMSNorm(args.dim)
        self.output: Optional[nn.Linear] = nn.Linear(args.dim, args.vocab_size, bias=False)

    def _precompute_freqs_cis(self) -> torch.Tensor:
        return precompute_freqs_cis(self.args.head_dim, self.args.max_seq_len * 2, self.args.rope_theta)

    def init_weights(self, buffer_device: Optional[torch.device] = None) -> None:
        """torchtitan's root init: re-create the RoPE cache, then walk the (present) modules."""
        buffer_device = buffer_device or self.freqs_cis.device
        with torch.device(buffer_device):
            self.freqs_cis = self._precompute_freqs_cis()
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights(buffer_device=buffer_device)
        if self.norm is not None:
            self.norm.reset_parameters()
        final_out_std = self.args.dim**-0.5
        cutoff_factor = 3
        if self.output is not None:
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_out_std,
                                  a=-cutoff_factor * final_out_std, b=cutoff_factor * final_out_std)


def build(flavour: str, device: str = "meta", **overrides: Any) -> Transformer:
    with torch.device(device):
        return Transformer(TitanArgs(flavour, **overrides))


def pipeline_stage(model: Transformer, stage: int, num_stages: int = 2) -> Transformer:
    """torchtitan's manual split: keep the FQNs, delete the layers this stage does not own, None the rest."""
    names = list(model.layers.keys())
    per_stage = len(names) // num_stages
    keep = set(names[stage * per_stage:(stage + 1) * per_stage] if stage < num_stages - 1
               else names[stage * per_stage:])
    for name in names:
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != num_stages - 1:
        model.norm = None
        model.output = None
    return model


# ----------------------------------------------------------------------------- parallel layouts
def fsdp_wrap(model: Transformer, mesh: Any = None) -> Transformer:
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if mesh is None else {"mesh": mesh}
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _expert_style() -> Any:
    """TP for grouped experts (torchtitan shards the hidden dim): w1/w3 Shard(1), w2 Shard(2)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class ExpertTensorParallel(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            for name, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
                param = getattr(module, name)
                sharded = distribute_tensor(param.data, device_mesh, [Shard(dim)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(sharded))
            return module

    return ExpertTensorParallel()


def tp_plan(model: Transformer) -> dict[str, Any]:
    """Megatron-style TP as torchtitan applies it (no forward is run, only placements matter)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel()
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel()
    for name, block in model.layers.items():
        prefix = f"layers.{name}"
        plan[f"{prefix}.attention.wqkv"] = ColwiseParallel()
        plan[f"{prefix}.attention.wo"] = RowwiseParallel()
        plan[f"{prefix}.attention_norm"] = SequenceParallel()
        plan[f"{prefix}.ffn_norm"] = SequenceParallel()
        if block.moe_enabled:
            plan[f"{prefix}.moe.experts"] = _expert_style()
            for linear, style in (("w1", ColwiseParallel), ("w2", RowwiseParallel), ("w3", ColwiseParallel)):
                plan[f"{prefix}.moe.shared_expert.{linear}"] = style()
        else:
            for linear, style in (("w1", ColwiseParallel), ("w2", RowwiseParallel), ("w3", ColwiseParallel)):
                plan[f"{prefix}.feed_forward.{linear}"] = style()
    return plan
