"""Small models for the multi-process tests: a Llama-like transformer and a conv net.

Sizes are odd on purpose (vocab 33, hidden 40) so shards are uneven.
"""

from __future__ import annotations

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 33, dim: int = 16, hidden: int = 40, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, hidden) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 5, 3)
        self.bn1 = nn.BatchNorm2d(5)
        self.conv2 = nn.Conv2d(5, 6, 3, groups=1)
        self.head = nn.Linear(6, 3)


#: Rules every test run uses, so FQN rules are exercised under every layout too.
LLAMA_RULES = {"layers.*.attention.w*.weight": "trunc_normal"}


def llama_rules():
    from keyinit import init

    return {"layers.*.attention.w*.weight": init.trunc_normal(std=0.02, a=-0.04, b=0.04)}


def tp_plan(model: TinyLlama) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {"tok_embeddings": RowwiseParallel(), "norm": SequenceParallel(), "output": ColwiseParallel()}
    for name in model.layers:
        prefix = f"layers.{name}"
        plan.update({
            f"{prefix}.attention_norm": SequenceParallel(),
            f"{prefix}.ffn_norm": SequenceParallel(),
            f"{prefix}.attention.wq": ColwiseParallel(),
            f"{prefix}.attention.wk": ColwiseParallel(),
            f"{prefix}.attention.wv": ColwiseParallel(),
            f"{prefix}.attention.wo": RowwiseParallel(),
            f"{prefix}.feed_forward.w1": ColwiseParallel(),
            f"{prefix}.feed_forward.w3": ColwiseParallel(),
            f"{prefix}.feed_forward.w2": RowwiseParallel(),
        })
    return plan


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full plain CPU tensor (gathers DTensors: call outside counted regions)."""
    out = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name] = full.detach().clone()
    return out
