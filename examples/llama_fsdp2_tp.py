"""Llama on a 2-D (dp, tp) mesh: meta init, TP + FSDP2, keyinit.materialize, one training step.

    torchrun --nproc-per-node 4 examples/llama_fsdp2_tp.py            # dp=2 x tp=2
    python examples/llama_fsdp2_tp.py --nproc 4                        # no torchrun: spawns 4 CPU ranks
    python examples/llama_fsdp2_tp.py --nproc 4 --tp 4 --model-size small

The model is built on the meta device (nothing allocated), parallelized with
``parallelize_module`` on the tp sub-mesh and ``fully_shard`` on the dp
sub-mesh (so TP-sharded weights get ``_StridedShard`` placements), and then
``keyinit.materialize`` allocates each rank's shards and fills them. Every
rank computes only its own elements, and the result is the single-process
model bit for bit. The script checks that (``--no-check`` skips it) by
gathering every parameter AFTER init and comparing it with a single-process
``keyinit.init_model`` of the same model, then runs one AdamW step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in a checkout

import keyinit  # noqa: E402
from examples.models import llama, llama_rules, tp_plan  # noqa: E402


def train(model_size: str = "tiny", tp: int = 2, seed: int = 0, check: bool = True, steps: int = 1) -> dict:
    """Runs in every rank of an initialized process group; returns this rank's summary."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import logging
    import warnings

    # The root returns TP's local view of the logits; we never modify it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    # full_tensor() of a _StridedShard parameter (the check) warns about sequential all-gathers.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % tp:
        raise ValueError(f"--tp {tp} does not divide the world size {world}")
    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))

    # 1. Build on meta: no memory, no init.
    with torch.device("meta"):
        model = llama(model_size)
    rules = llama_rules(model.args)

    # 2. Parallelize: TP inside each block, then FSDP2 over dp.
    parallelize_module(model, mesh["tp"], tp_plan(model))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    # 3. Allocate and initialize: each rank fills only its own shards, with no communication.
    report = keyinit.materialize(model, seed, device="cpu", rules=rules)
    if rank == 0:
        print(f"[rank 0] materialized {report.parameters} parameters: {report.local_elements:,} of "
              f"{report.elements:,} elements on this rank, in {report.seconds:.3f}s", flush=True)

    # 4. (Check) gather after init and compare with one process initializing the whole model.
    identical = None
    if check:
        with torch.device("meta"):
            reference = llama(model_size)
        keyinit.materialize(reference, seed, device="cpu", rules=rules)
        expected = dict(reference.named_parameters())
        identical = 0
        for fqn, param in model.named_parameters():
            full = param.full_tensor() if isinstance(param, DTensor) else param
            identical += bool(torch.equal(full.detach(), expected[fqn].detach()))
        if rank == 0:
            print(f"[rank 0] {identical}/{len(expected)} parameters equal the single-process init bit for bit",
                  flush=True)

    # 5. Train: data differs per dp rank and is shared inside a tp group.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1000 + mesh["dp"].get_local_rank())
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, model.args.vocab_size, (2, 17), generator=generator)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    if rank == 0:
        print(f"[rank 0] dp={dp} tp={tp}: loss after {steps} step(s) {losses[-1]:.4f}", flush=True)
    return {"rank": rank, "identical": identical, "total": len(list(model.parameters())), "loss": losses[-1]}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4, help="ranks to spawn when not run by torchrun (default 4)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--no-check", dest="check", action="store_false")
    args = parser.parse_args(argv)
    job = (args.model_size, args.tp, args.seed, args.check, args.steps)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            return [train(*job)]
        finally:
            dist.destroy_process_group()
    from keyinit.cli import spawn

    return spawn(train, args.nproc, job, preload=("torch.distributed.fsdp", "torch.distributed.tensor.parallel"))


if __name__ == "__main__":
    results = main()
    ok = all(r["identical"] in (None, r["total"]) for r in results)
    sys.exit(0 if ok else 1)
