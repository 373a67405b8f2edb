"""Keyed init of a fused weight written in parts, against the same shape drawn as one tensor.

    PYTHONPATH=$PWD python benchmarks/bench_fused_init.py [--rows 768 --cols 256 --rounds 3]

torchtitan's fused ``wqkv`` (``models/common/config_utils._fused_qkv_param_init``) draws q, k
and v on temporaries, ``cat``-s their per-head views along dim 1 and ``copy_``-s the result
into the weight; other init code writes slices of one weight (``w[:q].normal_()``, ...).
``keyinit.init_model(init_method="init_weights")`` captures that code and replays it, so the
replay goes through its ``cat`` and partial-write paths. The peer is a weight of the same shape
whose init draws it whole (``trunc_normal_(w)``), replayed by the same engine in the same run:
the ratio fused / whole is the cost of the parts (1 would be free).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import keyinit


class Fused(nn.Module):
    """One ``(rows, cols)`` weight initialised as torchtitan initialises its fused wqkv
    (``kind="cat"``), by slices of the weight (``kind="slices"``), or whole (``kind="whole"``)."""

    def __init__(self, rows: int, cols: int, kind: str, heads: int = 4) -> None:
        super().__init__()
        assert rows % 3 == 0 and (rows // 3) % heads == 0
        self.weight = nn.Parameter(torch.empty(rows, cols))
        self.kind, self.heads = kind, heads

    def init_weights(self) -> None:
        w, rows = self.weight, self.weight.shape[0]
        tail = w.shape[1:]
        with torch.no_grad():
            if self.kind == "whole":
                nn.init.trunc_normal_(w, std=0.02)
            elif self.kind == "slices":
                third = rows // 3
                for part in (w[:third], w[third:2 * third], w[2 * third:]):
                    nn.init.trunc_normal_(part, std=0.02)
            else:  # torchtitan's fused q/k/v: per-kv-head views of three temporaries, cat along dim 1
                kv, hd = self.heads, rows // 3 // self.heads
                q, k, v = (w.new_empty(rows // 3, *tail) for _ in range(3))
                for part in (q, k, v):
                    nn.init.trunc_normal_(part, std=0.02)
                fused = torch.cat([q.view(kv, 1, hd, *tail), k.view(kv, 1, hd, *tail),
                                   v.view(kv, 1, hd, *tail)], dim=1).view(-1, *tail)
                w.copy_(fused)


def keyed_seconds(module: nn.Module, seed: int = 7) -> float:
    start = time.perf_counter()
    keyinit.init_model(module, seed, init_method="init_weights")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=768)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    modules = {kind: Fused(args.rows, args.cols, kind) for kind in ("whole", "slices", "cat")}
    times: dict[str, list[float]] = {kind: [] for kind in modules}
    for _ in range(args.rounds):  # interleaved, so load on the machine hits every kind alike
        for kind, module in modules.items():
            times[kind].append(keyed_seconds(module))
    whole = statistics.median(times["whole"])
    print(f"keyed init_model of one ({args.rows}, {args.cols}) weight, median of {args.rounds} interleaved rounds")
    for kind, values in times.items():
        median = statistics.median(values)
        print(f"  {kind:7s} {median * 1e3:9.1f} ms   x{median / whole:7.2f} of whole")


if __name__ == "__main__":
    main()
