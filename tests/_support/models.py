"""Models for the multi-process tests: the shared Llama-like transformer and conv net at odd sizes.

The classes live in ``keyinit.cli.models`` (the demo uses them too); the tests
pick sizes that shard unevenly (vocab 33, FFN hidden 40) and their own TP plan,
which also puts the norms under sequence parallelism.
"""

from __future__ import annotations

import torch

from keyinit.cli.models import ConvNet, llama

__all__ = ["ConvNet", "TinyLlama", "llama_rules", "tp_plan", "full_state"]


def TinyLlama(vocab: int = 33) -> torch.nn.Module:  # noqa: N802 - a model factory named like the class
    return llama("tiny", dim=16, n_heads=2, n_kv_heads=1, vocab_size=vocab, ffn_hidden=40)


def llama_rules():
    """FQN rules every test run uses, so FQN rules are exercised under every layout too."""
    from keyinit import init

    return {"layers.*.attention.w*.weight": init.truncated_normal(std=0.02, a=-0.04, b=0.04)}


def tp_plan(model: torch.nn.Module) -> dict:
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


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full plain CPU tensor (gathers DTensors: call outside counted regions)."""
    out = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name] = full.detach().clone()
    return out
