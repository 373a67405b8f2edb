"""A first training script: a model that initializes itself, FSDP2, keyed data order and keyed dropout.

    python examples/first_training.py --nproc 2                  # own nn.Module, 2 gloo ranks, 3 steps
    python examples/first_training.py --nproc 2 --model hf       # HF Llama (tiny config, no hub)
    torchrun --nproc-per-node 2 examples/first_training.py       # the same under torchrun
    python examples/first_training.py --check                    # 1 and 2 ranks, compared

Everything random in the run is a function of the seed, never of the layout:

1. **Init.** The model is built with ``keyinit.deferred``: its constructor (here
   ``self.apply(self._init_weights)`` in ``__init__``; for HF, ``post_init``) runs on
   stand-ins that hold no memory, and is recorded. ``fully_shard`` shards the meta model;
   ``keyinit.materialize`` replays the constructor's own init, keyed by seed and FQN, for
   the shard each rank holds. No collective, no torch.nn default in place of the model's init.
2. **Data order.** ``keyinit.data.KeyedSampler`` gives each rank its contiguous slice of
   global batch ``t``; the global batch is the same for every world size.
3. **Dropout.** ``keyinit.nn.keyed(model, seed, step=t, samples=indices)`` keys every
   dropout (attention dropout included) by (seed, step, module FQN, call, the element's global
   sample and its place in it), so a sample's mask does not depend on which rank holds it; the
   indices the sampler yielded say where this rank's rows sit in the global batch (no offset to
   compute). ``docs/walkthrough.md`` does the same with dynamic padding and micro-batches.

The script prints each step's loss. ``--check`` runs it on 1 and on 2 ranks and compares:
the initial weights bit for bit (gathered), the losses within floating-point tolerance
(the gradient all-reduce sums in another order), and the init against the model's own.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in a checkout

import keyinit  # noqa: E402
from keyinit.data import KeyedSampler  # noqa: E402

VOCAB, DIM, SEQ, GLOBAL_BATCH, SAMPLES = 64, 32, 16, 8, 64


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False, is_causal=True,
                          attn_mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))[0]
        return x + self.mlp(x)


class TinyLM(nn.Module):
    """A newcomer's model: its init lives in ``__init__``, as in most research code."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(kind: str) -> nn.Module:
    if kind == "own":
        return TinyLM()
    from examples._torchvision import ensure_torchvision

    ensure_torchvision()  # transformers imports it
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attention_dropout=0.1)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    return list(model.layers) if hasattr(model, "layers") else list(model.model.layers)


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def dataset(seed: int) -> torch.Tensor:
    """``SAMPLES`` token sequences (a fixed, seeded corpus standing in for real data)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)


def train(kind: str = "own", seed: int = 0, steps: int = 3) -> dict:
    """One rank's run; returns its losses, the gathered initial weights and the init it got."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    model = keyinit.deferred(build, kind)          # 1. on meta, the constructor's init recorded
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = keyinit.materialize(model, seed, device="cpu")   # each rank fills its own shards
    initial = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}

    data = dataset(seed)
    sampler = KeyedSampler(len(data), seed, global_batch_size=GLOBAL_BATCH, rank=rank, world_size=world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    batches = sampler.batches()
    for step in range(steps):
        indices = next(batches)                   # 2. this rank's slice of global batch `step`
        rows = data[indices]
        tokens, targets = rows[:, :-1], rows[:, 1:]
        with keyinit.nn.keyed(model, seed, step=step, samples=indices):   # 3. keyed dropout
            logits = logits_of(model, tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)                    # the global mean loss, for printing
        losses.append(float(total) / world)
        if rank == 0:
            print(f"[{kind}, {world} rank(s)] step {step}: loss {losses[-1]:.5f}", flush=True)
    return {"rank": rank, "losses": losses, "initial": initial if rank == 0 else None,
            "defaults": list(report.defaults)}


def _run(kind: str, nproc: int, seed: int, steps: int) -> list[dict]:
    from keyinit.cli import spawn

    return spawn(train, nproc, (kind, seed, steps), preload=("torch.distributed.fsdp",))


def check(kind: str, seed: int = 0, steps: int = 3) -> dict:
    """Run on 1 and 2 ranks; compare initial weights (bitwise) and losses (tolerance); compare the
    init with the model's own eager init (embedding std)."""
    one, two = _run(kind, 1, seed, steps)[0], _run(kind, 2, seed, steps)
    identical = sum(torch.equal(one["initial"][n], two[0]["initial"][n]) for n in one["initial"])
    close = all(abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(one["losses"], two[0]["losses"]))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        eager = build(kind)
    emb = "emb.weight" if kind == "own" else "model.embed_tokens.weight"
    keyed_std, eager_std = float(one["initial"][emb].std()), float(eager.get_parameter(emb).detach().std())
    result = {"tensors": len(one["initial"]), "identical": identical, "losses_1": one["losses"],
              "losses_2": two[0]["losses"], "losses_close": close, "defaults": one["defaults"],
              "embedding_std": keyed_std, "eager_embedding_std": eager_std}
    print(f"initial weights bit-identical on 1 and 2 ranks: {identical}/{len(one['initial'])}; "
          f"losses within tolerance: {close}; embedding std {keyed_std:.4f} (the model's own init: "
          f"{eager_std:.4f}); torch.nn defaults used: {one['defaults'] or 'none'}", flush=True)
    return result


def main(argv: list[str] | None = None) -> object:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("own", "hf"), default="own")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not run by torchrun (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="run on 1 and 2 ranks and compare")
    args = parser.parse_args(argv)
    if args.check:
        return check(args.model, args.seed, args.steps)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            return [train(args.model, args.seed, args.steps)]
        finally:
            dist.destroy_process_group()
    return _run(args.model, args.nproc, args.seed, args.steps)


if __name__ == "__main__":
    result = main()
    if isinstance(result, dict):
        ok = result["identical"] == result["tensors"] and result["losses_close"] and not result["defaults"]
        sys.exit(0 if ok else 1)
