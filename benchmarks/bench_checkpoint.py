"""What activation checkpointing costs a keyed step, per draw: keyinit's own bookkeeping under checkpointing.

    PYTHONPATH=$PWD python benchmarks/bench_checkpoint.py [--depth 60] [--rounds 7] [--backward after]

A small model (``--blocks`` blocks of a ``Linear`` and ``--draws`` dropouts each, on a (4, 16) batch, so
that keyinit's Python work, not the kernels, is what is timed) runs a keyed forward and backward:

- ``plain``: no checkpointing (the peer, measured in the same run);
- ``reentrant`` / ``non-reentrant``: each block under ``torch.utils.checkpoint.checkpoint(block, x)``.

The step is called from ``--depth`` nested Python frames, as a training framework (Trainer, Lightning,
accelerate) calls it: keyinit once walked the Python stack on every draw and module call under
checkpointing, so its cost grew with that depth. ``backward()`` runs inside the keyed block by default
(``--backward after``: after it, where each recompute puts the block's hooks back on the model for its
call, a cost of its own). Printed: the median step CPU time of interleaved rounds, the extra time per draw
against ``plain`` (every draw runs twice under checkpointing: forward and recompute), and the ratio.
Run it against another checkout with its ``PYTHONPATH`` to compare.

Then the two checks themselves, per call, from inside a block's forward at that depth: the test a draw
makes under checkpointing (``unseen_recompute``: is it in a checkpointed function's own code?) and the
one a module makes (``hand_recomputes``: hand the recompute of the checkpoints around it to keyinit),
under torch's reentrant checkpoint and under saved-tensor hooks with no checkpoint around
(``torch.autograd.graph.save_on_cpu``), where a walk of the stack found nothing to stop at.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import keyinit
import keyinit.nn as knn


class Block(nn.Module):
    def __init__(self, width: int, draws: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drops = nn.ModuleList(nn.Dropout(0.1) for _ in range(draws))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        for drop in self.drops:
            h = drop(h)
        return F.dropout(h, 0.1, self.training) + x  # a draw in the block's own code too


class Net(nn.Module):
    def __init__(self, blocks: int, width: int, draws: int, how: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, draws) for _ in range(blocks))
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.how == "plain":
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.how == "reentrant")
        return x


def _nested(depth: int, fn):
    return fn() if depth <= 0 else _nested(depth - 1, fn)


class Probe(nn.Module):
    """Times ``unseen_recompute`` and ``hand_recomputes`` from inside its forward (keyinit's own checks)."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls, self.found = calls, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from keyinit.nn._recompute import checkpoint as _checkpoint, _keyed

        ctx, frame = _keyed.running_frame()
        for name, call in (("unseen_recompute", lambda: _checkpoint.unseen_recompute(frame)),
                           ("hand_recomputes", lambda: _checkpoint.hand_recomputes(ctx))):
            t0 = time.process_time()
            for _ in range(self.calls):
                call()
            self.found[name] = (time.process_time() - t0) / self.calls
        return x * 2


class Outer(nn.Module):
    def __init__(self, calls: int, where: str) -> None:
        super().__init__()
        self.probe, self.where = Probe(calls), where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                return self.probe(x)
        return checkpoint(self.probe, x, use_reentrant=True)


def probe(depth: int, calls: int) -> dict:
    found = {}
    for where in ("reentrant checkpoint", "save_on_cpu"):
        net = Outer(calls, where)
        x = torch.ones(4, 4, requires_grad=True)
        with knn.keyed(net, 1, step=0):
            _nested(depth, lambda: net(x))
        found[where] = net.probe.found
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--depth", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backward", choices=("inside", "after"), default="inside")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hows = ("plain", "reentrant", "non-reentrant")
    nets = {how: Net(args.blocks, args.width, args.draws, how).train() for how in hows}
    for net in nets.values():
        keyinit.init_model(net, 0)
    x = torch.linspace(-1, 1, 4 * args.width).reshape(4, args.width).requires_grad_()

    def step(how: str, i: int) -> None:
        net = nets[how]
        with knn.keyed(net, 1, step=i):
            loss = net(x).square().sum()
            if args.backward == "inside":
                loss.backward()
        if args.backward == "after":
            loss.backward()

    times: dict[str, list[float]] = {how: [] for how in hows}
    for how in hows:  # warm-up (kernels, caches)
        _nested(args.depth, lambda: step(how, 0))
    for _ in range(args.rounds):
        for how in hows:
            t0 = time.process_time()  # (CPU time of this process: other processes on the machine count less)
            for i in range(args.steps):
                _nested(args.depth, lambda: step(how, i))
            times[how].append((time.process_time() - t0) / args.steps)
    draws = args.blocks * (args.draws + 1)  # per forward
    plain = statistics.median(times["plain"])
    print(f"keyinit {keyinit.__file__}")
    print(f"{args.blocks} blocks x {args.draws + 1} draws, stack depth {args.depth}, backward {args.backward} the "
          f"block, median of {args.rounds} rounds of {args.steps} steps")
    print(f"{'':>14} {'step ms':>9} {'vs plain':>9} {'extra us/draw':>14}")
    for how in hows:
        t = statistics.median(times[how])
        extra = (t - plain) / draws * 1e6 if how != "plain" else 0.0
        print(f"{how:>14} {t * 1e3:9.2f} {t / plain:8.2f}x {extra:14.1f}")
    print(f"per call (us), stack depth {args.depth}:")
    for where, found in probe(args.depth, args.calls).items():
        print(f"  {where:>20}: " + ", ".join(f"{name} {t * 1e6:.2f}" for name, t in found.items()))


if __name__ == "__main__":
    main()
