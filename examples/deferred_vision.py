"""A vision model that initializes itself in ``__init__``, built with ``keyinit.deferred``, under FSDP2.

    torchrun --nproc-per-node 2 examples/deferred_vision.py                 # timm ViT, 2 ranks
    python examples/deferred_vision.py --nproc 2 --model torchvision:resnet18
    python examples/deferred_vision.py --nproc 4 --model timm:convnext_atto

The model (``timm:NAME`` through ``timm.create_model``, ``torchvision:NAME`` through
``torchvision.models.get_model``) is built with ``keyinit.deferred``: its constructor runs
on stand-ins, nothing is allocated, and its own init (trunc-normal position embeddings,
kaiming fan-out convs, zeroed heads) is recorded. Each rank then shards it with
``fully_shard`` and ``keyinit.materialize`` fills only its own shards, with no
communication. The script checks (``--no-check`` skips it) that every tensor equals the
single-process model bit for bit, then runs one SGD step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in a checkout

import keyinit  # noqa: E402


def _import_vision(library: str):
    """``import timm`` / ``import torchvision`` (see ``examples/_torchvision.py``)."""
    import importlib

    from examples._torchvision import ensure_torchvision

    ensure_torchvision()
    return importlib.import_module(library)


def builder(spec: str):
    """A no-argument builder for ``timm:NAME`` or ``torchvision:NAME`` (10 classes, small images)."""
    library, name = spec.split(":", 1)
    if library == "timm":
        timm = _import_vision("timm")
        extra = {"img_size": 32} if "vit" in name or "deit" in name else {}
        return lambda: timm.create_model(name, num_classes=10, **extra)
    if library == "torchvision":
        torchvision = _import_vision("torchvision")
        return lambda: torchvision.models.get_model(name, num_classes=10)
    raise ValueError(f"--model must be timm:NAME or torchvision:NAME, got {spec!r}")


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for n, t in [*model.named_parameters(), *model.named_buffers()]}


def run(spec: str, seed: int = 0, check: bool = True) -> dict:
    """Runs in every rank of an initialized process group; returns this rank's summary."""
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    build = builder(spec)

    # 1. Build: the constructor's own init recorded, nothing allocated.
    model = keyinit.deferred(build)

    # 2. Shard: FSDP2 on every block of the outermost ModuleLists/Sequentials, then the root.
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and module is not model:
            for block in module:
                if any(True for _ in block.parameters()):
                    fully_shard(block)
            break
    scalars = {p for p in model.parameters() if p.dim() == 0}  # fully_shard refuses 0-D parameters
    fully_shard(model, ignored_params=scalars or None)

    # 3. Allocate and initialize: each rank fills only its own shards.
    report = keyinit.materialize(model, seed, device="cpu")
    if rank == 0:
        print(f"[rank 0] {spec}: {report.parameters} parameters from {sorted(report.by_source())}; "
              f"{report.local_elements:,} of {report.elements:,} elements on this rank; "
              f"torch.nn defaults used: {len(report.defaults)}", flush=True)

    # 4. (Check) the single-process model, bit for bit.
    identical = total = None
    if check:
        expected = keyinit.deferred(build)
        keyinit.materialize(expected, seed, device="cpu")
        want, have = full_state(expected), full_state(model)
        total = len(want)
        identical = sum(bool(torch.equal(have[n], want[n])) for n in want)
        if rank == 0:
            print(f"[rank 0] {identical}/{total} tensors equal the single-process model bit for bit", flush=True)

    # 5. One training step on this rank's data.
    generator = torch.Generator().manual_seed(1000 + rank)
    images = torch.randn(2, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (2,), generator=generator)
    model.train()
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.01).step()
    return {"rank": rank, "identical": identical, "total": total, "loss": float(loss.detach()),
            "defaults": len(report.defaults)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not run by torchrun (default 2)")
    parser.add_argument("--model", default="timm:vit_tiny_patch16_224", help="timm:NAME or torchvision:NAME")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", dest="check", action="store_false")
    args = parser.parse_args(argv)
    job = (args.model, args.seed, args.check)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            return [run(*job)]
        finally:
            dist.destroy_process_group()
    from keyinit.cli import spawn

    return spawn(run, args.nproc, job, preload=("torch.distributed.fsdp",))


if __name__ == "__main__":
    results = main()
    sys.exit(0 if all(r["identical"] in (None, r["total"]) for r in results) else 1)
