"""Pipeline parallelism: initialize each stage on its own, get the single-process model.

    python examples/pipeline.py                    # spawns 2 CPU ranks = 2 stages
    python examples/pipeline.py --nproc 4          # 4 stages
    torchrun --nproc-per-node 2 examples/pipeline.py

Each rank builds the whole model on the meta device and cuts it to its stage
the torchtitan way (delete the layers it does not own, set the embedding /
final norm / output of other stages to None), so every tensor keeps its
ORIGINAL FQN and therefore its key. The model ties its output projection to
the token embedding: in one process they are ONE tensor, keyed as
``tok_embeddings.weight``. The last stage holds it only under the name
``output.weight``, so we declare the tie (``ties={"output.weight":
"tok_embeddings.weight"}``) and give both names the same rule. Each stage then
calls ``keyinit.materialize`` with no communication at all, and every stage's
weights equal the single-process init bit for bit, including the tied copy on
the last stage. Finally the stages run one GPipe step with
``torch.distributed.pipelining``.

(A real run also all-reduces the two copies' gradients of a tied weight
across the first and last stage; that is training, not init, and is left out.)
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
from examples.models import llama, llama_rules, pipeline_stage  # noqa: E402
from keyinit import init  # noqa: E402

#: The tied embedding's initializer, given under BOTH names: stage 0 has only
#: tok_embeddings.weight, the last stage only output.weight.
EMBEDDING = init.normal(std=0.02)
TIES = {"output.weight": "tok_embeddings.weight"}


def build(model_size: str, n_layers: int):
    with torch.device("meta"):
        model = llama(model_size, n_layers=n_layers, tie_embeddings=True)
    rules = {**llama_rules(model.args), "tok_embeddings.weight": EMBEDDING, "output.weight": EMBEDDING}
    return model, rules


def run_stage(model_size: str = "tiny", seed: int = 0, n_layers: int = 4, microbatches: int = 2) -> dict:
    """Runs in every rank (one stage per rank) of an initialized process group."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage_index, num_stages = dist.get_rank(), dist.get_world_size()

    # 1. This rank's stage, with the original FQNs, initialized on its own.
    model, rules = build(model_size, n_layers)
    stage_module = pipeline_stage(model, stage_index, num_stages)
    # strict=False: a stage holds only some of the FQNs the rules and ties name.
    keyinit.materialize(stage_module, seed, device="cpu", rules=rules, ties=TIES, strict=False)

    # 2. Compare with one process initializing the whole (tied) model.
    reference, _ = build(model_size, n_layers)
    # strict=False: in the full model output.weight IS tok_embeddings.weight, so its own rule never applies.
    keyinit.materialize(reference, seed, device="cpu", rules=rules, strict=False)
    expected = dict(reference.named_parameters(remove_duplicate=False))
    owned = dict(stage_module.named_parameters())
    identical = sum(bool(torch.equal(p.detach(), expected[fqn].detach())) for fqn, p in owned.items())
    print(f"[stage {stage_index}] {identical}/{len(owned)} parameters equal the single-process init: "
          f"{', '.join(sorted(n for n in owned if not n.startswith('layers.')) + [f'{len(stage_module.layers)} layers'])}",
          flush=True)

    # 3. One GPipe step over the stages.
    stage = PipelineStage(stage_module, stage_index, num_stages, device=torch.device("cpu"))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=loss_fn)
    tokens = torch.randint(0, reference.args.vocab_size, (2 * microbatches, 9), generator=torch.Generator().manual_seed(0))
    losses: list[torch.Tensor] = []
    if stage_index == 0:
        schedule.step(tokens[:, :-1])
    elif stage_index == num_stages - 1:
        schedule.step(target=tokens[:, 1:], losses=losses)
    else:
        schedule.step()
    loss = float(torch.stack(losses).mean().detach()) if losses else None
    if loss is not None:
        print(f"[stage {stage_index}] loss {loss:.4f}", flush=True)
    return {"stage": stage_index, "identical": identical, "total": len(owned), "loss": loss,
            "fqns": sorted(owned)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="stages (= ranks) to spawn without torchrun (default 2)")
    parser.add_argument("--model-size", default="tiny")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    job = (args.model_size, args.seed, args.layers)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            return [run_stage(*job)]
        finally:
            dist.destroy_process_group()
    from keyinit.cli import spawn

    return spawn(run_stage, args.nproc, job, preload=("torch.distributed.pipelining",))


if __name__ == "__main__":
    results = main()
    sys.exit(0 if all(r["identical"] == r["total"] for r in results) else 1)
