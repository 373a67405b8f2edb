"""Measure how peers initialize one rank's shard, and print the Markdown tables in docs/index.md.

    python examples/peers_table.py                       # 8192 x 2048 weight, 1/8 shard, 2 DTensor ranks
    python examples/peers_table.py --rows 4096 --cols 1024 --world 4

Part 1 (correctness, 2 real gloo ranks): a meta ``nn.Linear`` is sharded with
FSDP2 (``fully_shard``), allocated with ``to_empty`` and initialized with
``torch.nn.init.normal_`` after ``torch.manual_seed(0)``: are the two ranks'
shards different from each other, and equal to the single-process values?
Then the same with ``keyinit.materialize``.

Part 2 (cost of ONE rank's 1/world row shard of a rows x cols fp32 weight,
each approach in a fresh subprocess so its peak memory is its own):

* Megatron-style CPU init: build the full weight from the seed, keep the slice.
* seed checkpoint: one process initializes the full weight and saves it
  (one-time cost, a file the size of the weight); a rank loads its slice
  (``torch.load(mmap=True)``, reading only the slice's pages).
* keyinit: ``keyinit.random.normal(key, full_shape, region=the shard)``.

"Peak extra memory" is the growth of the process's peak RSS during the step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keyinit  # noqa: E402


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _one(approach: str, rows: int, cols: int, world: int, path: str) -> dict:
    torch.set_num_threads(1)
    r0, r1 = 0, -(-rows // world)
    base = _rss_kib()
    start = time.perf_counter()
    generated = 0
    if approach == "megatron":
        torch.manual_seed(0)
        full = torch.empty(rows, cols).normal_(0.0, 0.02)
        shard = full[r0:r1].clone()
        del full
        generated = rows * cols
    elif approach == "seed_checkpoint_save":
        torch.manual_seed(0)
        full = torch.empty(rows, cols).normal_(0.0, 0.02)
        torch.save({"weight": full}, path)
        shard = full[r0:r1]
        generated = rows * cols
    elif approach == "seed_checkpoint_load":
        state = torch.load(path, mmap=True)
        shard = state["weight"][r0:r1].clone()
        del state
    elif approach == "keyinit":
        key = keyinit.key_for(0, "weight")
        shard = keyinit.random.normal(key, (rows, cols), std=0.02, region=(slice(r0, r1), slice(None)))
        generated = shard.numel()
    else:
        raise ValueError(approach)
    seconds = time.perf_counter() - start
    peak = max(_peak_kib() - base, 0)
    return {"seconds": seconds, "peak_mib": peak / 1024, "generated": generated, "shard": shard.numel(),
            "file_mib": os.path.getsize(path) / 2**20 if approach == "seed_checkpoint_save" else 0.0}


def _dtensor_rank(use_keyinit: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = torch.nn.Linear(16, 16, bias=False)
    fully_shard(model, mesh=mesh)
    if use_keyinit:
        keyinit.materialize(model, 0, device="cpu", rules={"weight": keyinit.init.normal(std=0.02)})
    else:
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            torch.nn.init.normal_(model.weight, std=0.02)
    local = model.weight.to_local().detach().clone()
    full = model.weight.full_tensor().detach().clone()
    return {"local": local, "full": full}


def dtensor_part() -> list[list[str]]:
    from keyinit.cli import spawn

    single_torch = torch.empty(16, 16)
    torch.manual_seed(0)
    torch.nn.init.normal_(single_torch, std=0.02)
    single_keyinit = torch.empty(16, 16)
    keyinit.init.normal(std=0.02)(keyinit.key_for(0, "weight"),
                                  keyinit.layouts.Target("weight", keyinit.regions.make_region((16, 16), None),
                                                         single_keyinit))
    rows = []
    for label, use_keyinit, single in (("torch.nn.init.normal_ on DTensor (CPU)", False, single_torch),
                                       ("keyinit.materialize", True, single_keyinit)):
        a, b = spawn(_dtensor_rank, 2, (use_keyinit,), preload=("torch.distributed.fsdp",))
        rows.append([label, "yes" if torch.equal(a["local"], b["local"]) else "no",
                     "yes" if torch.equal(a["full"], single) else "no"])
    return rows


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--skip-dtensor", action="store_true", help="skip part 1 (spawns 2 ranks)")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one, args.rows, args.cols, args.world, args.path)))
        return ""

    lines = []
    if not args.skip_dtensor:
        lines += ["| 2 FSDP2 ranks, meta `nn.Linear(16, 16)`, then init | rank 0 shard == rank 1 shard | "
                  "gathered == single process |", "|---|---|---|"]
        lines += [f"| {a} | {b} | {c} |" for a, b, c in dtensor_part()]
        lines.append("")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "seed.pt")
        results = {}
        for approach in ("megatron", "seed_checkpoint_save", "seed_checkpoint_load", "keyinit"):
            proc = subprocess.run([sys.executable, __file__, "--one", approach, "--rows", str(args.rows),
                                   "--cols", str(args.cols), "--world", str(args.world), "--path", path],
                                  capture_output=True, text=True, check=True)
            results[approach] = json.loads(proc.stdout.strip().splitlines()[-1])
    full_mib = args.rows * args.cols * 4 / 2**20
    m, s, l, k = (results[a] for a in ("megatron", "seed_checkpoint_save", "seed_checkpoint_load", "keyinit"))
    lines += [f"| one rank's 1/{args.world} row shard of a {args.rows} x {args.cols} fp32 weight ({full_mib:.0f} MiB) "
              f"| elements drawn on the rank | peak extra memory | time on the rank | other cost |",
              "|---|---:|---:|---:|---|",
              f"| Megatron-style CPU init (full weight, keep slice) | {m['generated']:,} | {m['peak_mib']:.0f} MiB "
              f"| {m['seconds']:.3f} s | - |",
              f"| seed checkpoint: load the slice (`torch.load(mmap=True)`) | 0 | {l['peak_mib']:.0f} MiB "
              f"| {l['seconds']:.3f} s | once: init + save {s['seconds']:.3f} s, {s['file_mib']:.0f} MiB file per seed |",
              f"| keyinit (`random.normal(..., region=shard)`) | {k['generated']:,} | {k['peak_mib']:.0f} MiB "
              f"| {k['seconds']:.3f} s | - |"]
    try:
        import keyinit._kernels  # noqa: F401 - present once the compiled kernels are merged
        path = "compiled CPU kernel (unless KEYINIT_DISABLE_KERNELS=1)"
    except ImportError:
        path = "the pure-torch reference implementation"
    lines += ["", f"keyinit filled the shard with {path}; torch {torch.__version__}, "
                  f"{os.cpu_count()} CPU cores, 1 torch thread per process."]
    table = "\n".join(lines)
    print(table)
    return table


if __name__ == "__main__":
    main()
