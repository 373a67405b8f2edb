"""keyinit benchmarks against its peers, each peer measured in the same run.

    python benchmarks/bench.py                 # everything this machine can run (CPU; plus GPU with CUDA)
    python benchmarks/bench.py --only 1        # just the CPU targets
    python benchmarks/bench.py --only 6        # just the GPU targets (needs CUDA and triton)
    python benchmarks/bench.py --quick         # smaller model, fewer repeats
    python benchmarks/bench.py --only 6 --gpu-dry-run   # the GPU section's code on CPU, tiny sizes

Every ratio is peer time / keyinit time (> 1 means keyinit is faster), except
where a row says otherwise. Rows that are targets of issue 9 print the target
and whether this run met it.

1. CPU targets: keyinit.random.normal/uniform vs torch.Tensor.normal_/uniform_,
   fp32 and bf16, 1-D 2**24 and 2-D 4096x4096, at 1 and 2 threads (target >= 1.0x);
2. TP shard: one rank's shard of a 11008x4096 weight vs the "Megatron CPU init"
   peer (build the full fp32 weight with torch's RNG, keep the slice);
3. weak scaling: a 1/N region of that weight vs the full weight;
4. seed checkpoint: torchtitan-style (init the whole model with torch's RNG,
   save it with torch.distributed.checkpoint, load it back, keep one rank's
   shards) vs keyinit drawing that rank's shards directly (regions);
5. peak memory: peak RSS (VmHWM) growth of a fresh process doing one rank's
   init, vs the size of the shard it keeps;
6. GPU targets (CUDA only): uniform/bernoulli vs torch, normal vs normal_,
   trunc_normal vs nn.init.trunc_normal_, uniform vs fill_ bandwidth, 1-D vs
   2-D, first-call vs warm materialize of a ~200M model, llama3-8b bf16 warm
   materialize vs to_empty + reset_parameters;
7. Triton compile time: each kernel variant compiled for sm_90 on this
   machine's CPU (no GPU needed), in a fresh process with an empty cache;
8. keyed dropout (benchmarks/bench_dropout.py): keyinit.nn.functional.dropout
   forward and forward+backward vs F.dropout, fp32 and bf16, at 1 and 2 threads
   (CUDA: bf16/fp32 (8, 4096, 4096)), and the activation memory each saves;
9. existing init code: a Hugging Face Llama built on the CPU (its own
   _init_weights, torch's RNG) vs built on meta and materialized by keyinit with
   init_method=model._init_weights (capture + keyed replay), same process;
11. (``--only d``) keyinit.deferred (benchmarks/bench_deferred.py): constructing an 8B
   Llama (HF and torchtitan shapes) recorded vs under torch.device("meta"), time and
   peak memory, and replaying a 125M HF Llama vs the init_method path.

Timing: the peer and keyinit are timed alternately (in alternating order) in
every round, and each side's MEDIAN over the rounds is reported, so both see the
same machine load. This is not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
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
from keyinit._kernels.fill import cpu as _cpu  # noqa: E402

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


# ---------------------------------------------------------------- 1. CPU targets


def median_pair(peer, mine, rounds: int, sync=lambda: None) -> tuple[float, float]:
    """Median times of ``peer`` and ``mine`` over ``rounds`` rounds; each round runs both,
    in alternating order, so both see the same load. ``sync`` waits for the device."""
    peer()
    mine()
    sync()
    times_peer, times_mine = [], []
    for r in range(rounds):
        order = ((peer, times_peer), (mine, times_mine))
        for fn, times in (order if r % 2 == 0 else order[::-1]):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
    return statistics.median(times_peer), statistics.median(times_mine)


def _target(ratio: float, goal: float, at_least: bool = True) -> str:
    met = ratio >= goal if at_least else ratio <= goal
    return f"{'>=' if at_least else '<='} {goal:g}: {'met' if met else 'NOT met'}"


def bench_cpu_targets(rounds: int, thread_counts: tuple[int, ...]) -> None:
    rows = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for shape, label in (((1 << 24,), "1-D 2**24"), ((4096, 4096), "2-D 4096x4096")):
            for dtype in (torch.float32, torch.bfloat16):
                buf = torch.empty(shape, dtype=dtype)
                n = buf.numel()
                for dist in ("normal", "uniform"):
                    if dist == "normal":
                        peer = lambda: buf.normal_(0.0, 1.0)  # noqa: E731
                        mine = lambda: kr.normal(KEY, shape, dtype=dtype, out=buf)  # noqa: E731
                    else:
                        peer = lambda: buf.uniform_(0.0, 1.0)  # noqa: E731
                        mine = lambda: kr.uniform(KEY, shape, dtype=dtype, out=buf)  # noqa: E731
                    t_peer, t_ki = median_pair(peer, mine, rounds)
                    ratio = t_peer / t_ki
                    rows.append([f"{dist} vs {dist}_", str(dtype).replace("torch.", ""), label, threads,
                                 f"{t_peer * 1e3:.1f}", f"{t_ki * 1e3:.1f}", f"{n / t_ki / 1e6:.0f}",
                                 f"{ratio:.2f}x", _target(ratio, 1.0)])
    table("1. CPU targets: keyinit vs torch's own RNG into the same buffer (same thread count; median of "
          f"{rounds} interleaved rounds)",
          ["op", "dtype", "shape", "threads", "torch ms", "keyinit ms", "keyinit M/s", "ratio", "target"], rows)


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


# ---------------------------------------------------------------- 6. GPU targets

_MODEL_CHILD = r"""
import json, statistics, sys, time, torch
sys.path.insert(0, sys.argv[1])
import keyinit
from keyinit.cli.models import llama
device, size, dtype, rounds, mode = sys.argv[2], sys.argv[3], getattr(torch, sys.argv[4]), int(sys.argv[5]), sys.argv[6]
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
if device.startswith("cuda"):  # CUDA context and torch's own kernels up before any timing
    torch.empty(1 << 20, device=device).uniform_()
    sync()

def meta_model():
    with torch.device("meta"):
        return llama(size).to(dtype)

def keyinit_materialize():
    model = meta_model()
    sync(); start = time.perf_counter()
    keyinit.materialize(model, 0, device=device)
    sync(); return time.perf_counter() - start, sum(p.numel() for p in model.parameters())

def torch_reset():
    model = meta_model()
    sync(); start = time.perf_counter()
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    sync(); return time.perf_counter() - start

if mode == "first":  # a fresh process with an empty Triton cache: the first call compiles
    first, params = keyinit_materialize()
    warm = [keyinit_materialize()[0] for _ in range(rounds)]
    print(json.dumps({"params": params, "first": first, "warm": statistics.median(warm)}))
else:  # warm keyinit vs to_empty + reset_parameters, interleaved
    keyinit_materialize(); torch_reset()
    mine, peer = [], []
    for r in range(rounds):
        for fn, times in (((keyinit_materialize, mine), (torch_reset, peer)) if r % 2 == 0 else
                          ((torch_reset, peer), (keyinit_materialize, mine))):
            result = fn()
            times.append(result[0] if isinstance(result, tuple) else result)
    print(json.dumps({"params": keyinit_materialize()[1], "keyinit": statistics.median(mine),
                      "torch": statistics.median(peer)}))
"""


def _model_child(device: str, size: str, dtype: str, rounds: int, mode: str) -> dict:
    env = dict(os.environ)
    cache = tempfile.mkdtemp(prefix="keyinit-bench-triton-")
    env["TRITON_CACHE_DIR"] = cache  # cold: nothing compiled before this process
    try:
        proc = subprocess.run([sys.executable, "-c", _MODEL_CHILD, str(REPO), device, size, dtype, str(rounds), mode],
                              capture_output=True, text=True, env=env)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"model benchmark failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_gpu(rounds: int, dry_run: bool) -> None:
    """Section 6. ``dry_run`` runs the same code on the CPU with small sizes (its numbers mean nothing)."""
    if dry_run:
        device, side, sync = "cpu", 512, (lambda: None)
        big_model, small_model = "medium", "small"
    else:
        if not torch.cuda.is_available():
            print("\n## 6. GPU targets\n\nskipped: no CUDA device on this machine")
            return
        from keyinit._kernels.fill import triton as triton_kernel

        if not triton_kernel.available():
            print("\n## 6. GPU targets\n\nskipped: triton is not installed")
            return
        device, side, sync = "cuda", 16384, torch.cuda.synchronize
    shape2d, shape1d = (side, side), (side * side,)
    rows = []

    def add(op, dtype, shape, t_peer, t_ki, value, target):
        rows.append([op, str(dtype).replace("torch.", ""), shape, f"{t_peer * 1e3:.3f}", f"{t_ki * 1e3:.3f}",
                     value, target])

    for dtype in (torch.float32, torch.bfloat16):
        buf = torch.empty(shape2d, dtype=dtype, device=device)
        flat = buf.view(-1)
        label = f"{side}x{side}"
        pairs = [
            ("uniform vs uniform_", lambda: buf.uniform_(), lambda: kr.uniform(KEY, shape2d, dtype=dtype, out=buf), 1.0),
            ("bernoulli vs bernoulli_", lambda: buf.bernoulli_(0.5),
             lambda: kr.bernoulli(KEY, shape2d, p=0.5, dtype=dtype, out=buf), 1.0),
            ("normal vs normal_", lambda: buf.normal_(), lambda: kr.normal(KEY, shape2d, dtype=dtype, out=buf), 0.5),
            ("trunc_normal vs trunc_normal_", lambda: torch.nn.init.trunc_normal_(buf),
             lambda: kr.truncated_normal(KEY, shape2d, dtype=dtype, out=buf), 1.5),
        ]
        for op, peer, mine, goal in pairs:
            t_peer, t_ki = median_pair(peer, mine, rounds, sync)
            add(op, dtype, label, t_peer, t_ki, f"{t_peer / t_ki:.2f}x", _target(t_peer / t_ki, goal))
        t_fill, t_ki = median_pair(lambda: buf.fill_(1.0), lambda: kr.uniform(KEY, shape2d, dtype=dtype, out=buf),
                                   rounds, sync)
        gbs = buf.numel() * buf.element_size() / t_ki / 1e9
        add("uniform vs fill_ (bandwidth share)", dtype, label, t_fill, t_ki,
            f"{t_fill / t_ki:.0%} ({gbs:.0f} GB/s)", _target(t_fill / t_ki, 0.7))
        for name, draw in (("uniform", kr.uniform), ("normal", kr.normal)):
            t_2d, t_1d = median_pair(lambda: draw(KEY, shape2d, dtype=dtype, out=buf),
                                     lambda: draw(KEY, shape1d, dtype=dtype, out=flat), rounds, sync)
            add(f"{name} 1-D {side * side} vs 2-D (time 1-D / 2-D)", dtype, "1-D", t_2d, t_1d,
                f"{t_1d / t_2d:.2f}", _target(t_1d / t_2d, 1.1, at_least=False))
        del buf, flat
    table(f"6. GPU targets ({'DRY RUN on the CPU: numbers mean nothing' if dry_run else torch.cuda.get_device_name()}; "
          f"median of {rounds} interleaved rounds; peer ms / keyinit ms)",
          ["op", "dtype", "shape", "peer ms", "keyinit ms", "result", "target"], rows)

    first_size, big_size = (small_model, big_model) if dry_run else ("large", "llama3-8b")
    first = _model_child(device, first_size, "float32", rounds, "first")
    warm8b = _model_child(device, big_size, "bfloat16", max(3, rounds // 2), "warm")
    over = first["first"] - first["warm"]
    ratio = warm8b["keyinit"] / warm8b["torch"]
    table("6b. Whole-model materialize on the device (fresh process, empty Triton cache; CUDA context made "
          "before timing)",
          ["what", "params", "value", "target"],
          [[f"{first_size} fp32: first materialize minus warm ({first['first']:.3f} s - {first['warm']:.3f} s)",
            f"{first['params'] / 1e6:.0f}M", f"{over:.3f} s", _target(over, 1.0, at_least=False)],
           [f"{big_size} bf16: warm materialize / (to_empty + reset_parameters) "
            f"({warm8b['keyinit']:.3f} s / {warm8b['torch']:.3f} s)",
            f"{warm8b['params'] / 1e9:.2f}B", f"{ratio:.2f}x", _target(ratio, 3.0, at_least=False)]])


# ------------------------------------------------------- 7. Triton compile time

_COMPILE_CHILD = r"""
import inspect, json, sys, time
sys.path.insert(0, sys.argv[1])
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from keyinit._kernels.fill import triton_impl as impl

fn = impl._fill_kernel
params = inspect.signature(fn.fn).parameters
results = []
for label, family, words, out_type, out_kind, run in (
        ("uniform/normal/trunc_normal -> float32, RUN path", 0, 1, "*fp32", 0, 1),
        ("uniform/normal/trunc_normal -> bfloat16, RUN path", 0, 1, "*i16", 2, 1),
        ("uniform/normal/trunc_normal -> float32, GENERAL path", 0, 1, "*fp32", 0, 0),
        ("randint -> int64, RUN path", 1, 2, "*i64", 5, 1),
        ("bernoulli -> bool, RUN path", 2, 1, "*u8", 4, 1)):
    constexprs = {"FAMILY": family, "W": words, "OUT": out_kind, "NB": impl.NB,
                  "BLOCK": impl.BLOCK, "RUN": run, "ALIGNED": run}
    signature = {name: (out_type if name == "out_ptr" else "*i64" if name == "index_ptr" else
                        "constexpr" if name in constexprs else
                        "fp32" if params[name].annotation is impl.F32 else "i64") for name in fn.arg_names}
    start = time.perf_counter()
    triton_compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", int(sys.argv[2]), 32), options={"enable_fp_fusion": False})
    results.append([label, time.perf_counter() - start])
print(json.dumps(results))
"""


def bench_triton_compile(arch: int = 90) -> None:
    """Section 7: compile each kernel variant for an NVIDIA target on this machine's CPU (no GPU needed)."""
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        print(f"\n## 7. Triton compile time\n\nskipped: Triton's NVIDIA backend is unavailable ({exc})")
        return
    cache = tempfile.mkdtemp(prefix="keyinit-bench-triton-")
    try:
        proc = subprocess.run([sys.executable, "-c", _COMPILE_CHILD, str(REPO), str(arch)], capture_output=True,
                              text=True, env=dict(os.environ, TRITON_CACHE_DIR=cache))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"compile benchmark failed:\n{proc.stderr[-3000:]}")
    rows = [[label, f"{seconds:.2f}"] for label, seconds in json.loads(proc.stdout.strip().splitlines()[-1])]
    table(f"7. Triton kernel compile time for sm_{arch}, on this machine's CPU (fresh process, empty cache; one "
          "variant serves every distribution of a value family, any shape, region, key and parameters; the first "
          "row includes the process's one-time compiler start-up)",
          ["variant", "compile s"], rows)


def bench_dropout(quick: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_dropout as dropout  # noqa: E402 - the dropout benchmark lives next to this file

    print("\n## 8. keyed dropout vs F.dropout (ratio = torch time / keyinit time; target >= 1.0x)\n")
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        dropout.print_report(dropout.run(device, quick))


def bench_init_code(rounds: int) -> None:
    try:
        import transformers
    except ImportError:
        print("\n## 9. existing init code: skipped (transformers is not installed)")
        return
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                      num_attention_heads=12, num_key_value_heads=4, pad_token_id=0)

    def hf_native():
        with torch.device("cpu"):
            transformers.LlamaForCausalLM(config)

    def keyed():
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        keyinit.materialize(model, 0, device="cpu", init_method=model._init_weights)

    from keyinit._engine.planning.plan import plan_model

    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    start = time.perf_counter()
    plan_model(meta, 0, init_method=meta._init_weights, materializing=True)
    plan_seconds = time.perf_counter() - start
    numel = sum(p.numel() for p in meta.parameters())
    runs = max(3, rounds // 3)
    t_hf, t_keyinit = median_pair(hf_native, keyed, runs)
    table(f"9. existing init code: HF Llama ({numel / 1e6:.0f}M parameters), {torch.get_num_threads()} threads, "
          f"median of {runs}",
          ["path", "seconds", "ratio (HF / keyinit)"],
          [["HF on CPU: constructor + its own _init_weights (torch RNG)", f"{t_hf:.3f}", ""],
           ["keyinit.materialize(meta model, init_method=model._init_weights)", f"{t_keyinit:.3f}",
            f"{t_hf / t_keyinit:.2f}x"],
           ["  of which planning (capture of _init_weights on stand-ins)", f"{plan_seconds:.3f}", ""]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2-layer model, fewer repeats")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="'all threads' (default: all cores)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per target (default 15, quick 5)")
    parser.add_argument("--only", default="123456789d", help="sections to run, e.g. 16 (d: section 11)")
    parser.add_argument("--gpu-dry-run", action="store_true", help="run section 6's code on the CPU with tiny sizes")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    rounds = args.rounds or (5 if args.quick else 15)
    layers = 2 if args.quick else 22
    torch.set_num_threads(args.threads)
    if not _cpu.available():
        raise SystemExit(f"compiled kernel unavailable: {_cpu.failure_reason()}")
    print(f"# keyinit benchmarks\n\nmachine: {cpu_model()}, {os.cpu_count()} logical CPUs; torch {torch.__version__}; "
          f"python {platform.python_version()}; 'all threads' = {args.threads}\n"
          f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; command: python benchmarks/bench.py {' '.join(sys.argv[1:])}\n"
          f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if "1" in args.only:
        bench_cpu_targets(rounds, tuple(sorted({1, 2, args.threads})))
        torch.set_num_threads(args.threads)
    if "2" in args.only:
        bench_tp(repeats)
    if "3" in args.only:
        bench_weak_scaling(repeats)
    if "4" in args.only:
        bench_seed_checkpoint(layers, 8)
    if "5" in args.only:
        bench_memory(layers, 8)
    if "6" in args.only:
        bench_gpu(rounds, args.gpu_dry_run)
    if "7" in args.only:
        bench_triton_compile()
    if "8" in args.only:
        bench_dropout(args.quick)
    if "9" in args.only:
        bench_init_code(rounds)
    if "d" in args.only:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_deferred  # noqa: E402 - section 11 lives next to this file

        bench_deferred.run(rounds, median_pair, table)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
