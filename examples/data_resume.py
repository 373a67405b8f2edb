"""Keyed data order: train at W=2, checkpoint, resume at W=4, and get the same global batches.

    torchrun --nproc-per-node 2 examples/data_resume.py --steps 0:3 --save /tmp/keyinit_data_ckpt.pt
    torchrun --nproc-per-node 4 examples/data_resume.py --steps 3:6 --load /tmp/keyinit_data_ckpt.pt
    python examples/data_resume.py --check      # no torchrun: both runs spawned, compared with one process

Every rank iterates a DataLoader (2 workers under torchrun; none in spawned ranks) over ``keyed_samples(dataset, seed)``
with a ``KeyedSampler``; each item's augmentation draws ``torch.randn`` noise and
flips with ``torch.rand``, keyed by (seed, epoch, sample). Each step all-gathers
the global batch (sample indices and augmented inputs), averages the gradients of
a tiny linear model and steps SGD. Rank 0 prints each global batch. The
checkpoint holds the model, the optimizer and ``sampler.state_dict()`` (the
next step); the resumed run may use any world size that divides the batch.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in a checkout

from keyinit.data import KeyedSampler, keyed_samples  # noqa: E402

N, BATCH, SEED = 40, 8, 2024


class Points(torch.utils.data.Dataset):
    """Sample i: 4 features from its index, augmented with keyed noise and a keyed sign flip."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        x = torch.arange(4, dtype=torch.float32) * 0.1 + i * 0.01
        x = x + 0.05 * torch.randn(4)
        if torch.rand(()) < 0.5:
            x = -x
        return x, torch.tensor([float(i % 7)]), i


def run(first: int, last: int, load: str | None, save: str | None, workers: int = 2) -> dict:
    """Steps [first, last) in this rank of an initialized process group; returns what rank 0 printed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the model's own init (keyinit is not needed for this toy)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = KeyedSampler(N, SEED, global_batch_size=BATCH, start_step=first, num_steps=last - first,
                           yield_epoch=True)  # rank and world size from torch.distributed
    if load:
        state = torch.load(load, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sampler.load_state_dict(state["sampler"])
        assert sampler.step == first, f"the checkpoint holds step {sampler.step}, not {first}"
    loader = torch.utils.data.DataLoader(keyed_samples(Points(), SEED), batch_size=BATCH // world, sampler=sampler,
                                         num_workers=workers)
    batches, digests = [], []
    for step, (x, y, index) in zip(range(first, last), loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        all_index = [torch.empty_like(index) for _ in range(world)]
        all_x = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(all_index, index)
        dist.all_gather(all_x, x)
        global_batch = torch.cat(all_index).tolist()
        digest = hashlib.sha256(torch.cat(all_x).numpy().tobytes()).hexdigest()[:16]
        batches.append(global_batch)
        digests.append(digest)
        if rank == 0:
            print(f"W={world} step {step}: global batch {global_batch}  augmented inputs sha256 {digest}", flush=True)
    if save and rank == 0:
        # The DataLoader reads ahead of training, so record the TRAINING step (the sampler's own
        # step may be ahead); the state_dict's fingerprint checks n, seed, batch size and stream.
        state = {**sampler.state_dict(), "step": last}
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sampler": state}, save)
    dist.barrier()
    return {"batches": batches, "digests": digests, "weight": model.weight.detach().clone()}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="0:3", help="first:last step (last excluded)")
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="spawn W=2 then W=4 (resumed) and W=1; compare")
    args = parser.parse_args(argv)
    first, last = (int(s) for s in args.steps.split(":"))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            return [run(first, last, args.load, args.save, args.workers)]
        finally:
            dist.destroy_process_group()
    from keyinit.cli import spawn

    args.workers = 0  # spawned ranks are daemon processes, which cannot start DataLoader workers
    if not args.check:
        return spawn(run, 2, (first, last, args.load, args.save, args.workers))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt.pt")
        part1 = spawn(run, 2, (0, 3, None, ckpt, args.workers))[0]
        part2 = spawn(run, 4, (3, 6, ckpt, None, args.workers))[0]
    whole = spawn(run, 1, (0, 6, None, None, args.workers))[0]
    same = part1["batches"] + part2["batches"] == whole["batches"]
    same_aug = part1["digests"] + part2["digests"] == whole["digests"]
    print(f"global batches of W=2 (steps 0-2) + W=4 resumed (steps 3-5) == W=1 (steps 0-5): {same}")
    print(f"augmented inputs identical: {same_aug}")
    return [part1, part2, whole]


if __name__ == "__main__":
    results = main()
    if len(results) == 3 and not (results[0]["batches"] + results[1]["batches"] == results[2]["batches"]):
        sys.exit(1)
