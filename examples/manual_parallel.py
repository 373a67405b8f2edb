"""Hand-cut shards, no DTensor: an embedding table split across ranks by the user.

    python examples/manual_parallel.py                 # simulates 4 ranks in this process
    python examples/manual_parallel.py --world-size 3 --vocab 1000 --dim 16
    torchrun --nproc-per-node 2 examples/manual_parallel.py   # real ranks; each checks its own shard

Recommendation models shard huge embedding tables by hand (Lightning's
"manual" parallelism). Here each rank owns a slice of a ``(vocab, dim)``
table in a plain module, ``ShardedEmbedding``, whose local parameter is
called ``local``. Two things make keyinit initialize it as if it were the
whole table:

* ``keyinit.layouts.declare_shard(module, "local", global_shape=..., region=...)``
  says which rows/columns of the global table the local tensor holds;
* ``fqn_map={"table.local": "table.weight"}`` names it like the unsharded
  model's parameter, so it gets the same key.

Three shardings are shown: contiguous row blocks (uneven), round-robin rows
(``rows = rank::world``) and column blocks. Every rank's shard equals the
same slice of the single-process table, bit for bit, with no communication.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in a checkout

import keyinit  # noqa: E402
from keyinit import init  # noqa: E402
from keyinit.layouts import declare_shard  # noqa: E402

INIT = init.normal(std=0.02)


class Model(nn.Module):
    """The single-process model: a full table."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, dim)


class ShardedEmbedding(nn.Module):
    """A rank's part of the table: ``local`` holds rows ``rows`` and columns ``cols`` of it."""

    def __init__(self, vocab: int, dim: int, rows: slice, cols: slice) -> None:
        super().__init__()
        n_rows = len(range(*rows.indices(vocab)))
        n_cols = len(range(*cols.indices(dim)))
        self.local = nn.Parameter(torch.empty(n_rows, n_cols))
        declare_shard(self, "local", global_shape=(vocab, dim), region=(rows, cols))


class ShardedModel(nn.Module):
    def __init__(self, vocab: int, dim: int, rows: slice, cols: slice) -> None:
        super().__init__()
        self.table = ShardedEmbedding(vocab, dim, rows, cols)


def shard_of(kind: str, rank: int, world: int, vocab: int, dim: int) -> tuple[slice, slice]:
    """The (rows, cols) this rank holds under each sharding."""
    if kind == "row blocks":
        per = -(-vocab // world)  # uneven: the last rank gets fewer rows
        return slice(rank * per, min((rank + 1) * per, vocab)), slice(None)
    if kind == "round-robin rows":
        return slice(rank, None, world), slice(None)
    if kind == "column blocks":
        per = -(-dim // world)
        return slice(None), slice(rank * per, min((rank + 1) * per, dim))
    raise ValueError(kind)


KINDS = ("row blocks", "round-robin rows", "column blocks")


def init_shard(kind: str, rank: int, world: int, vocab: int, dim: int, seed: int) -> ShardedModel:
    rows, cols = shard_of(kind, rank, world, vocab, dim)
    model = ShardedModel(vocab, dim, rows, cols)
    keyinit.init_model(model, seed, fqn_map={"table.local": "table.weight"}, rules={"table.weight": INIT})
    return model


def main(argv: list[str] | None = None) -> dict[str, bool]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4, help="ranks to simulate in this process (default 4)")
    parser.add_argument("--vocab", type=int, default=1001)
    parser.add_argument("--dim", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    # The single-process reference: the whole table.
    full = Model(args.vocab, args.dim)
    keyinit.init_model(full, args.seed, rules={"table.weight": INIT})
    table = full.table.weight.detach()

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: this process is one real rank
        ranks, world = [int(os.environ["RANK"])], int(os.environ["WORLD_SIZE"])
    else:
        ranks, world = list(range(args.world_size)), args.world_size

    results = {}
    for kind in KINDS:
        same = True
        for rank in ranks:
            shard = init_shard(kind, rank, world, args.vocab, args.dim, args.seed).table.local.detach()
            rows, cols = shard_of(kind, rank, world, args.vocab, args.dim)
            same &= torch.equal(shard, table[rows, cols])
        results[kind] = same
        print(f"{kind:<17} over {world} ranks: every shard == full table[rows, cols]: {same}")
    return results


if __name__ == "__main__":
    sys.exit(0 if all(main().values()) else 1)
