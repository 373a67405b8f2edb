"""keyinit benchmarks against its peers, each peer measured in the same run.

    python benchmarks/bench.py            # full run (a few minutes)
    python benchmarks/bench.py --quick    # smaller model, fewer repeats

Sections (every ratio is peer time / keyinit time, so > 1 means keyinit is faster):

1. throughput: keyinit.random.normal/uniform vs torch.Tensor.normal_/uniform_,
   fp32 and bf16, 2**24 elements, same thread count, 1 thread and all threads;
2. TP shard: one rank's shard of a 11008x4096 weight vs the "Megatron CPU init"
   peer (build the full fp32 weight with torch's RNG, keep the slice);
3. weak scaling: a 1/N region of that weight vs the full weight;
4. seed checkpoint: torchtitan-style (init the whole model with torch's RNG,
   save it with torch.distributed.checkpoint, load it back, keep one rank's
   shards) vs keyinit drawing that rank's shards directly (regions);
5. peak memory: peak RSS (VmHWM) growth of a fresh process doing one rank's
   init, vs the size of the shard it keeps.

Timings are the best of several repeats (wall clock). This is not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import keyinit  # noqa: E402
from keyinit import random as kr  # noqa: E402
from keyinit._kernels import _cpu  # noqa: E402

KEY = keyinit.key(1234)


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up (page faults, first build of the kernel)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def best_of_pair(peer, mine, repeats: int) -> tuple[float, float]:
    """Best times of ``peer`` and ``mine``, measured alternately so both see the same machine load."""
    peer()
    mine()
    best_peer = best_mine = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        peer()
        best_peer = min(best_peer, time.perf_counter() - start)
        start = time.perf_counter()
        mine()
        best_mine = min(best_mine, time.perf_counter() - start)
    return best_peer, best_mine


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n## {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(x).ljust(w) for x, w in zip(row, widths)) + " |")


# ---------------------------------------------------------------- 1. throughput


def bench_throughput(repeats: int, all_threads: int) -> None:
    from keyinit import _dispatch
    from keyinit.distributions import Normal, Uniform
    from keyinit.regions import make_region

    rows = []
    # "prebuilt": the same 1-D fill through keyinit._dispatch with the Region made once,
    # i.e. without make_region's 2**24-entry int64 index vector (see docs/benchmarks.md).
    for shape, label in (((4096, 4096), "4096x4096"), ((1 << 24,), "2**24"), ((1 << 24,), "2**24 prebuilt")):
        n = 1
        for s in shape:
            n *= s
        region = make_region(shape, None)
        for dist in ("normal", "uniform"):
            for dtype in (torch.float32, torch.bfloat16):
                buf = torch.empty(shape, dtype=dtype)
                for threads in sorted({1, all_threads}):
                    torch.set_num_threads(threads)
                    if dist == "normal":
                        peer = lambda: buf.normal_(0.0, 1.0)  # noqa: E731
                        mine = lambda: kr.normal(KEY, shape, dtype=dtype, out=buf)  # noqa: E731
                        d = Normal.create(0.0, 1.0)
                    else:
                        peer = lambda: buf.uniform_(0.0, 1.0)  # noqa: E731
                        mine = lambda: kr.uniform(KEY, shape, dtype=dtype, out=buf)  # noqa: E731
                        d = Uniform.create(0.0, 1.0)
                    if label.endswith("prebuilt"):
                        mine = lambda: _dispatch.fill(buf, d, KEY, region)  # noqa: E731
                    t_peer, t_ki = best_of_pair(peer, mine, repeats)
                    rows.append([dist, str(dtype).replace("torch.", ""), label, threads,
                                 f"{n / t_peer / 1e6:.0f}", f"{n / t_ki / 1e6:.0f}", f"{t_peer / t_ki:.2f}x"])
    torch.set_num_threads(all_threads)
    table("1. Throughput vs torch's own RNG (2**24 elements, same thread count)",
          ["dist", "dtype", "shape", "threads", "torch M/s", "keyinit M/s", "ratio"], rows)


# ----------------------------------------------------------- 2./3. TP and scaling

WEIGHT = (11008, 4096)  # Llama-7B MLP up-projection [out, in]


def megatron_cpu_shard(rows: slice) -> torch.Tensor:
    master = torch.empty(WEIGHT, dtype=torch.float32)
    master.normal_(0.0, 0.02)
    return master[rows].clone()


def bench_tp(repeats: int) -> None:
    out_rows = []
    for tp in (2, 4, 8):
        rows = WEIGHT[0] // tp
        cols = WEIGHT[1] // tp
        t_peer, t_col = best_of_pair(lambda: megatron_cpu_shard(slice(0, rows)),
                                     lambda: kr.normal(KEY, WEIGHT, std=0.02, region=(slice(0, rows), slice(None))),
                                     repeats)
        t_row = best_of(lambda: kr.normal(KEY, WEIGHT, std=0.02, region=(slice(None), slice(cols, 2 * cols))), repeats)
        out_rows.append([tp, f"{t_peer * 1e3:.1f}", f"{t_col * 1e3:.1f}", f"{t_peer / t_col:.1f}x",
                         f"{t_row * 1e3:.1f}", f"{t_peer / t_row:.1f}x"])
    table(f"2. One TP rank's shard of a {WEIGHT[0]}x{WEIGHT[1]} fp32 weight vs Megatron CPU init (all threads)",
          ["TP", "Megatron ms", "keyinit colwise ms", "ratio", "keyinit rowwise ms", "ratio"], out_rows)


def bench_weak_scaling(repeats: int) -> None:
    """Time for 1/N of the weight, with a fresh output (what a user calls) and into a
    preallocated ``out`` (the kernel alone: no page faults of a new allocation)."""
    full_buf = torch.empty(WEIGHT)
    full_fresh = best_of(lambda: kr.normal(KEY, WEIGHT, std=0.02), repeats)
    full_out = best_of(lambda: kr.normal(KEY, WEIGHT, std=0.02, out=full_buf), repeats)
    rows = [[1, f"{full_fresh * 1e3:.2f}", "1.00", f"{full_out * 1e3:.2f}", "1.00"]]
    for n in (2, 4, 8, 16, 32):
        r = WEIGHT[0] // n
        region = (slice(r, 2 * r), slice(None))
        buf = torch.empty(r, WEIGHT[1])
        fresh = best_of(lambda: kr.normal(KEY, WEIGHT, std=0.02, region=region), repeats)
        into = best_of(lambda: kr.normal(KEY, WEIGHT, std=0.02, region=region, out=buf), repeats)
        rows.append([n, f"{fresh * 1e3:.2f}", f"{fresh / (full_fresh / n):.2f}",
                     f"{into * 1e3:.2f}", f"{into / (full_out / n):.2f}"])
    table(f"3. Weak scaling: rows [r, 2r) = 1/N of a {WEIGHT[0]}x{WEIGHT[1]} weight (all threads); "
          "ratio = time / (full time / N)",
          ["N", "fresh output ms", "ratio", "into out= ms", "ratio"], rows)


# ------------------------------------------------------------ 4. seed checkpoint


def llama_shapes(layers: int) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """TinyLlama-1.1B-like parameter shapes with their TP shard dim (None: replicated)."""
    hidden, inter, vocab, kv = 2048, 5632, 32000, 256
    shapes: dict[str, tuple[tuple[int, ...], int | None]] = {"tok_embeddings.weight": ((vocab, hidden), 0)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes[p + "attention.wq.weight"] = ((hidden, hidden), 0)
        shapes[p + "attention.wk.weight"] = ((kv, hidden), 0)
        shapes[p + "attention.wv.weight"] = ((kv, hidden), 0)
        shapes[p + "attention.wo.weight"] = ((hidden, hidden), 1)
        shapes[p + "feed_forward.w1.weight"] = ((inter, hidden), 0)
        shapes[p + "feed_forward.w3.weight"] = ((inter, hidden), 0)
        shapes[p + "feed_forward.w2.weight"] = ((hidden, inter), 1)
        shapes[p + "attention_norm.weight"] = ((hidden,), None)
        shapes[p + "ffn_norm.weight"] = ((hidden,), None)
    shapes["norm.weight"] = ((hidden,), None)
    shapes["output.weight"] = ((vocab, hidden), 0)
    return shapes


def shard_region(shape, dim, tp, rank):
    if dim is None:
        return None
    size = shape[dim] // tp
    region = [slice(None)] * len(shape)
    region[dim] = slice(rank * size, (rank + 1) * size)
    return tuple(region)


def keyinit_rank_init(shapes, tp, rank):
    out = {}
    for fqn, (shape, dim) in shapes.items():
        if len(shape) == 1:
            out[fqn] = torch.ones(shape)
        else:
            out[fqn] = kr.normal(keyinit.key_for(KEY, fqn), shape, std=0.02, region=shard_region(shape, dim, tp, rank))
    return out


def bench_seed_checkpoint(layers: int, tp: int) -> None:
    import torch.distributed.checkpoint as dcp
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    shapes = llama_shapes(layers)
    numel = sum(torch.Size(s).numel() for s, _ in shapes.values())
    ckpt = Path(tempfile.mkdtemp(prefix="keyinit-seed-ckpt-"))
    try:
        start = time.perf_counter()
        model = {}
        for fqn, (shape, _) in shapes.items():
            t = torch.empty(shape)
            if len(shape) == 1:
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02)
            model[fqn] = t
        t_init = time.perf_counter() - start
        start = time.perf_counter()
        dcp.save(model, checkpoint_id=str(ckpt), no_dist=True)
        t_save = time.perf_counter() - start
        del model
        # Load for rank 0 of TP=tp: DCP reads the full tensors (single process), keep the shards.
        start = time.perf_counter()
        loaded = {fqn: torch.empty(shape) for fqn, (shape, _) in shapes.items()}
        dcp.load(loaded, checkpoint_id=str(ckpt), no_dist=True)
        shards = {}
        for fqn, (shape, dim) in shapes.items():
            region = shard_region(shape, dim, tp, 0)
            shards[fqn] = loaded[fqn][region].clone() if region else loaded[fqn]
        del loaded
        t_load = time.perf_counter() - start
        start = time.perf_counter()
        mine = keyinit_rank_init(shapes, tp, 0)
        t_ki = time.perf_counter() - start
        assert all(mine[f].shape == shards[f].shape for f in shapes)
        peer = t_init + t_save + t_load
        table(f"4. Seed checkpoint vs direct region init ({layers}-layer TinyLlama-1.1B shapes, "
              f"{numel / 1e9:.2f}B params, rank 0 of TP={tp}, all threads)",
              ["method", "init s", "save s", "load+reshard s", "total s", "ratio"],
              [["torch init + DCP save + DCP load", f"{t_init:.2f}", f"{t_save:.2f}", f"{t_load:.2f}",
                f"{peer:.2f}", "1.0x"],
               ["keyinit rank-local regions", f"{t_ki:.2f}", "-", "-", f"{t_ki:.2f}", f"{peer / t_ki:.1f}x"]])
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


# ---------------------------------------------------------------- 5. memory

_MEM_CHILD = r"""
import json, resource, sys, torch

def peak_rss():
    # VmHWM belongs to this process image; ru_maxrss would also count the parent's
    # size at fork time, which Linux carries across exec.
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

sys.path.insert(0, sys.argv[1])
import keyinit
from keyinit import random as kr
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import bench
mode, tp, layers = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kr.normal(keyinit.key(0), (64, 64))  # import, build/load the kernel, touch the allocator
base = peak_rss()
if mode == "keyinit_model":
    out = bench.keyinit_rank_init(bench.llama_shapes(layers), tp, 0)
elif mode == "keyinit_weight":
    out = {"w": kr.normal(bench.KEY, bench.WEIGHT, std=0.02, region=bench.shard_region(bench.WEIGHT, 0, tp, 0))}
elif mode == "megatron_weight":
    out = {"w": bench.megatron_cpu_shard(slice(0, bench.WEIGHT[0] // tp))}
peak = peak_rss()
print(json.dumps({"delta": peak - base, "kept": sum(t.numel() * t.element_size() for t in out.values())}))
"""


def bench_memory(layers: int, tp: int) -> None:
    rows = []
    for mode, label in (("keyinit_model", f"keyinit, {layers}-layer model, rank 0 of TP={tp}"),
                        ("keyinit_weight", f"keyinit, {WEIGHT[0]}x{WEIGHT[1]} weight, rank 0 of TP={tp}"),
                        ("megatron_weight", f"Megatron CPU init, same weight shard")):
        proc = subprocess.run([sys.executable, "-c", _MEM_CHILD, str(REPO), mode, str(tp), str(layers)],
                              capture_output=True, text=True, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append([label, f"{r['kept'] / 2**20:.1f}", f"{r['delta'] / 2**20:.1f}",
                     f"{(r['delta'] - r['kept']) / 2**20:+.1f}"])
    table("5. Peak memory (peak RSS growth of a fresh process) vs the shard it keeps",
          ["what", "kept MiB", "peak growth MiB", "overhead MiB"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2-layer model, fewer repeats")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="'all threads' (default: all cores)")
    parser.add_argument("--only", default="12345", help="sections to run, e.g. 12")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    layers = 2 if args.quick else 22
    torch.set_num_threads(args.threads)
    if not _cpu.available():
        raise SystemExit(f"compiled kernel unavailable: {_cpu.failure_reason()}")
    print(f"# keyinit benchmarks\n\nmachine: {cpu_model()}, {os.cpu_count()} logical CPUs; torch {torch.__version__}; "
          f"python {platform.python_version()}; 'all threads' = {args.threads}\n"
          f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; command: python benchmarks/bench.py {' '.join(sys.argv[1:])}")
    if "1" in args.only:
        bench_throughput(repeats, args.threads)
    if "2" in args.only:
        bench_tp(repeats)
    if "3" in args.only:
        bench_weak_scaling(repeats)
    if "4" in args.only:
        bench_seed_checkpoint(layers, 8)
    if "5" in args.only:
        bench_memory(layers, 8)


if __name__ == "__main__":
    main()
