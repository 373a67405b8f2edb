"""Keyed stochastic rounding against the randint-and-mask peer, and a keyed SR AdamW step against round to nearest.

    python benchmarks/bench_sround.py            # 1M and 16M elements, 1 and 2 threads; the AdamW step
    python benchmarks/bench_sround.py --quick    # fewer repeats
    python benchmarks/bench_sround.py --only ops # (or --only adamw, --only torchao, --only fp4, --only compiled) one section
    python benchmarks/bench_sround.py --device cuda  # on the GPU: the Triton kernels against the same peers

Sections (every ratio is peer time / keyinit time, so >= 1 means keyinit is at least as fast):

1. per element, float32 -> bfloat16 and -> float16, into a preallocated tensor:
   ``keyinit.random.stochastic_round(key, x, dtype, out=out)`` (the compiled CPU kernel, ``docs/spec.md``
   section 17) vs the randint-and-mask SR of OneTrainer and torchao's bf16 optimizers,
   ``(x.view(torch.int32) + torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)) & -65536``, in its
   fastest form (in place, the truncated float32 converted exactly into ``out``; the form read as
   bfloat16 through its upper half, ``.view(torch.bfloat16)[..., 1::2]``, is measured too); for float16
   the same with 13 random bits (``& -8192``, then converted to float16, exact in float16's normal
   range): the global RNG's draws, not keyed;
2. one AdamW step of a small bfloat16 MLP (4 blocks of 512 -> 2048 -> 512, 8.4M parameters, gradients
   fixed): ``keyinit.optim.stochastic_rounding(..., fused=True)`` (the one-pass step, ``docs/spec.md``
   17.6: bf16 parameter and gradient, float32 state, keyed SR; no float32 copies) vs torch's AdamW on the
   bf16 parameters as they are (bf16 state, round to nearest; its default CPU path, the single-tensor
   loop): the target, <= 1.1. Also ``fused=False`` (float32 step, keyed SR into the bf16 parameters) vs
   (a) the same float32 step with the new values rounded to nearest (the same hooks, the rounding
   replaced by ``out.copy_(x)``: the cost of SR itself) and (b) torch's AdamW on the bf16 parameters
   as they are (bf16 state, round to nearest);
3. (torchao installed) one step of torchao's ``_AdamW(bf16_stochastic_round=True)`` on the same MLP:
   keyed by ``keyinit.optim.stochastic_rounding`` (torchao's compiled step on float32 stand-ins, then
   keyed SR) vs torchao's own step (its compiled step on the bf16 parameters, ``torch.randint`` SR);
4. per element, float32 -> FP4 E2M1 codes with an MX block scale (a power of two per 32 elements):
   ``keyinit.random.stochastic_round_fp4(key, x, scale, out=out)`` with the compiled kernel
   (``docs/spec.md`` 17.7, ``fill/sround_fp4.h``) vs the same call on the torch reference
   (``KEYINIT_DISABLE_KERNELS=1``; the same codes); and the rounding alone, the kernel
   (``keyinit._kernels.fill.cpu.sround_fp4``) vs ``keyinit._draw.reference_sround.round_fp4_into``, on
   the float64 quotients (``--device cuda``: the Triton kernel, ``triton_sround.sround_fp4``). Fewer
   repeats (a third, at least 3): the reference is slow. Printed before section 3.
5. ``--only compiled``: ``torch.compile(opt.step)`` (inductor) of AdamW on the same MLP under
   ``keyinit.optim.stochastic_rounding`` (``fused=False``: the compiled float32 step, then keyed SR; and
   ``fused=True``) vs ``torch.compile(opt.step)`` of torch's AdamW on the bf16 parameters as they are (bf16
   state, round to nearest). Not in the default run (inductor compiles for a minute on the CPU).

With ``--device cuda`` the same sections run on the GPU (the Triton kernels; section 1 at 16M and 64M
elements; section 2 on a larger MLP, 4 blocks of 1024 -> 4096 -> 1024, 33.6M parameters, with torch's
AdamW in its CUDA default (``foreach``) and ``fused=True`` forms as peers; each timed call ends with
``torch.cuda.synchronize()``).

Timings alternate peer and keyinit call by call (round ``r`` starts with a different one) after a warm-up
and report the MEDIAN of the repeats. This is not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import keyinit  # noqa: E402
import keyinit.optim  # noqa: E402
from keyinit.random import stochastic_round  # noqa: E402

KEY = keyinit.key(1234)
DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def median_all(fns, repeats: int) -> list[float]:
    """Median wall times of each of ``fns``, called in turn (round ``r`` starting at ``fns[r % len]``)."""
    for fn in fns:
        fn()
    _sync()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        first = r % len(fns)
        for i in (*range(first, len(fns)), *range(first)):
            start = time.perf_counter()
            fns[i]()
            _sync()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def peer_bf16_upper_half(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """OneTrainer / torchao, as written: 16 random low bits added to the float32 pattern, truncated; the
    upper half read as bfloat16 (little-endian: element 1 of each pair) and copied into ``out``."""
    rounded = (x.view(torch.int32) + torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)) & -65536
    return out.copy_(rounded.view(torch.bfloat16)[..., 1::2])


def peer_bf16(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The same arithmetic in place, the truncated float32 converted (exactly) into ``out``: the fastest form
    measured here (4.2 ns per element against 6.9 for :func:`peer_bf16_upper_half`, 1 thread, 4M), the peer."""
    rounded = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)
    rounded.add_(x.view(torch.int32)).bitwise_and_(-65536)
    return out.copy_(rounded.view(torch.float32))


def peer_fp16(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The same for float16's 13 dropped fraction bits (float16's normal range), converted to float16."""
    rounded = torch.randint(0, 1 << 13, x.shape, dtype=torch.int32, device=x.device)
    rounded.add_(x.view(torch.int32)).bitwise_and_(-8192)
    return out.copy_(rounded.view(torch.float32))


PEERS = {torch.bfloat16: peer_bf16, torch.float16: peer_fp16}
#: Measured beside the peers (the bf16 peer as OneTrainer / torchao write it).
ALSO = {torch.bfloat16: peer_bf16_upper_half}


def bench_ops(sizes, threads_list, repeats: int) -> list[dict]:
    rows = []
    for n in sizes:
        x = keyinit.random.normal(keyinit.key(7), (n,), std=1.0, device=DEVICE)
        for threads in threads_list:
            torch.set_num_threads(threads)
            for dtype, peer in PEERS.items():
                out_peer = torch.empty(n, dtype=dtype, device=DEVICE)
                out_mine = torch.empty(n, dtype=dtype, device=DEVICE)
                fns = [lambda: peer(x, out_peer), lambda: stochastic_round(KEY, x, dtype, out=out_mine)]
                if dtype in ALSO:
                    fns.append(lambda: ALSO[dtype](x, out_peer))
                t_peer, t_mine, *t_also = median_all(fns, repeats)
                rows.append({"n": n, "threads": threads, "dtype": str(dtype).removeprefix("torch."),
                             "peer_ns": 1e9 * t_peer / n, "keyinit_ns": 1e9 * t_mine / n,
                             "ratio": t_peer / t_mine, "also_ns": [1e9 * t / n for t in t_also]})
    return rows


def _without_kernels(fn):
    """``fn`` run with ``KEYINIT_DISABLE_KERNELS=1`` (the dispatch reads it at each call): the reference."""
    def run():
        os.environ["KEYINIT_DISABLE_KERNELS"] = "1"
        try:
            return fn()
        finally:
            del os.environ["KEYINIT_DISABLE_KERNELS"]
    return run


def bench_fp4(sizes, threads_list, repeats: int) -> list[dict]:
    from keyinit._draw.reference_sround import round_fp4_into
    from keyinit._kernels.fill import cpu, triton_sround
    from keyinit.random import stochastic_round_fp4
    from keyinit.regions import make_region

    kernel = cpu.sround_fp4 if DEVICE.type == "cpu" else triton_sround.sround_fp4
    rows = []
    for n in sizes:
        x = keyinit.random.normal(keyinit.key(7), (n // 32, 32), std=3.0, device=DEVICE)
        scale = torch.exp2(torch.randint(-3, 3, (n // 32, 1), generator=torch.Generator().manual_seed(0)).float())
        scale = scale.to(DEVICE)
        v = x.double() / scale.double()
        region = make_region(tuple(x.shape), None)
        out_kernel, out_ref = (torch.empty(x.shape, dtype=torch.uint8, device=DEVICE) for _ in range(2))
        for threads in threads_list:
            torch.set_num_threads(threads)
            fns = [_without_kernels(lambda: stochastic_round_fp4(KEY, x, scale, out=out_ref)),
                   lambda: stochastic_round_fp4(KEY, x, scale, out=out_kernel),
                   lambda: round_fp4_into(out_ref, v, KEY, region),
                   lambda: kernel(out_kernel, v, KEY, region)]
            t_ref, t_mine, t_ref_round, t_mine_round = median_all(fns, repeats)
            if not torch.equal(out_kernel, out_ref):
                raise AssertionError("the kernel's FP4 codes are not the reference's")
            rows.append({"n": n, "threads": threads, "ref_ns": 1e9 * t_ref / n, "keyinit_ns": 1e9 * t_mine / n,
                         "ratio": t_ref / t_mine, "ref_round_ns": 1e9 * t_ref_round / n,
                         "round_ns": 1e9 * t_mine_round / n, "round_ratio": t_ref_round / t_mine_round})
    return rows


def _mlp() -> torch.nn.Module:
    dim = 1024 if DEVICE.type == "cuda" else 512
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)]
    model = torch.nn.Sequential(*layers)
    keyinit.init_model(model, seed=0)
    model.to(device=DEVICE, dtype=torch.bfloat16)
    for fqn, p in model.named_parameters():
        p.grad = keyinit.random.normal(keyinit.key_for(keyinit.key(9), fqn), p.shape, std=1e-3, dtype=p.dtype,
                                              device=p.device)
    return model


def _nearest(handle, t):
    """``StochasticRounding._round_stand_ins`` with the rounding replaced by round to nearest (``copy_``)."""
    with torch.no_grad():
        for _, _, param, stand_in in handle._swapped:
            param.copy_(stand_in)


def bench_adamw(threads_list, repeats: int) -> list[dict]:
    rows = []
    keyed, nearest, plain, fused = _mlp(), _mlp(), _mlp(), _mlp()
    opt_fused = torch.optim.AdamW(fused.parameters(), lr=1e-4)
    keyinit.optim.stochastic_rounding(opt_fused, 5, names=fused, fused=True)
    opt_keyed = torch.optim.AdamW(keyed.parameters(), lr=1e-4)
    keyinit.optim.stochastic_rounding(opt_keyed, 5, names=keyed)
    opt_nearest = torch.optim.AdamW(nearest.parameters(), lr=1e-4)
    keyinit.optim.stochastic_rounding(opt_nearest, 5, names=nearest)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    torch_fused = _mlp()  # torch's fused AdamW (round to nearest): the fastest torch step on CUDA
    opt_torch_fused = torch.optim.AdamW(torch_fused.parameters(), lr=1e-4, fused=True)

    def step_nearest():
        with mock.patch.object(keyinit.optim.StochasticRounding, "_round_stand_ins", _nearest):
            opt_nearest.step()

    params = sum(p.numel() for p in keyed.parameters())
    for threads in threads_list:
        torch.set_num_threads(threads)
        t_keyed, t_nearest, t_plain, t_fused, t_torch_fused = median_all(
            (opt_keyed.step, step_nearest, opt_plain.step, opt_fused.step, opt_torch_fused.step), repeats)
        rows.append({"torch_fused_ms": 1e3 * t_torch_fused, "fused/torch_fused": t_fused / t_torch_fused,
                     "threads": threads, "params": params, "keyed_ms": 1e3 * t_keyed, "fused_ms": 1e3 * t_fused,
                     "fused/bf16_torch": t_fused / t_plain,
                     "f32_nearest_ms": 1e3 * t_nearest, "bf16_torch_ms": 1e3 * t_plain,
                     "keyed/f32_nearest": t_keyed / t_nearest, "keyed/bf16_torch": t_keyed / t_plain})
    return rows


def profile_fused(steps: int) -> None:
    """cProfile of ``steps`` fused keyed SR AdamW steps on the benchmark MLP (the host's share of a step)."""
    import cProfile
    import pstats

    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    keyinit.optim.stochastic_rounding(opt, 5, names=model, fused=True)
    opt.step()
    _sync()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        opt.step()
    profiler.disable()
    _sync()
    print(f"\nprofile: {steps} fused steps, {1e3 * (time.perf_counter() - start) / steps:.2f} ms a step under cProfile")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(14)


def bench_torchao(threads_list, repeats: int) -> list[dict]:
    import torchao.optim

    keyed, own = _mlp(), _mlp()
    opt_keyed = torchao.optim._AdamW(keyed.parameters(), lr=1e-4, bf16_stochastic_round=True)
    keyinit.optim.stochastic_rounding(opt_keyed, 5, names=keyed)
    opt_own = torchao.optim._AdamW(own.parameters(), lr=1e-4, bf16_stochastic_round=True)
    rows = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        t_keyed, t_own = median_all((opt_keyed.step, opt_own.step), repeats)  # (the warm-up compiles)
        rows.append({"threads": threads, "keyed_ms": 1e3 * t_keyed, "own_ms": 1e3 * t_own, "ratio": t_keyed / t_own})
    return rows


def bench_compiled(threads_list, repeats: int) -> list[dict]:
    torch._dynamo.reset()
    keyed, fused, plain = _mlp(), _mlp(), _mlp()
    opt_keyed = torch.optim.AdamW(keyed.parameters(), lr=1e-4)
    keyinit.optim.stochastic_rounding(opt_keyed, 5, names=keyed)
    opt_fused = torch.optim.AdamW(fused.parameters(), lr=1e-4)
    keyinit.optim.stochastic_rounding(opt_fused, 5, names=fused, fused=True)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    steps = [torch.compile(opt.step) for opt in (opt_keyed, opt_fused, opt_plain)]
    for step in steps:  # compile (the first two steps make the state): outside the timing
        step()
        step()
    rows = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        t_keyed, t_fused, t_plain = median_all(steps, repeats)
        rows.append({"threads": threads, "keyed_ms": 1e3 * t_keyed, "fused_ms": 1e3 * t_fused,
                     "plain_ms": 1e3 * t_plain})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=("ops", "adamw", "torchao", "fp4", "compiled"))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--profile", action="store_true",
                        help="also: cProfile of 20 fused keyed SR AdamW steps (where the host's time goes)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    threads = args.threads if DEVICE.type == "cpu" else [torch.get_num_threads()]
    sizes = (1 << 20, 1 << 24) if DEVICE.type == "cpu" else (1 << 24, 1 << 26)
    repeats = 7 if args.quick else 21
    where = torch.cuda.get_device_name() if DEVICE.type == "cuda" else f"{torch.get_num_threads()} threads available"
    print(f"torch {torch.__version__}, {where}; medians of {repeats}")
    if args.only in (None, "ops"):
        print("\n1. stochastic rounding per element, float32 -> dtype (ratio: peer / keyinit, >= 1.0 is the target)")
        print(f"{'n':>9} {'thr':>3} {'dtype':>9} {'peer ns':>8} {'keyinit ns':>10} {'ratio':>6}  upper-half peer ns")
        for r in bench_ops(sizes, threads, repeats):
            also = " ".join(f"{t:.3f}" for t in r["also_ns"])
            print(f"{r['n']:>9} {r['threads']:>3} {r['dtype']:>9} {r['peer_ns']:>8.3f} {r['keyinit_ns']:>10.3f} "
                  f"{r['ratio']:>6.2f}  {also}")
    if args.only in (None, "adamw"):
        print("\n2. one AdamW step, bf16 MLP (ratio: keyed / peer, <= 1.1 is the target)")
        for r in bench_adamw(threads, repeats):
            print(f"threads {r['threads']}, {r['params']} parameters: keyed SR fused {r['fused_ms']:.2f} ms, torch "
                  f"AdamW on bf16 {r['bf16_torch_ms']:.2f} ms: ratio {r['fused/bf16_torch']:.3f}")
            print(f"  fused=False: keyed SR {r['keyed_ms']:.2f} ms, "
                  f"float32 step + round to nearest {r['f32_nearest_ms']:.2f} ms "
                  f"(ratio {r['keyed/f32_nearest']:.3f}), torch AdamW on bf16 {r['bf16_torch_ms']:.2f} ms "
                  f"(ratio {r['keyed/bf16_torch']:.3f})")
            print(f"  torch AdamW(fused=True) on bf16 (round to nearest) {r['torch_fused_ms']:.2f} ms: keyed SR "
                  f"fused / it {r['fused/torch_fused']:.3f}")
    if args.profile:
        profile_fused(20)
    if args.only in (None, "fp4"):
        print("\n4. stochastic rounding to FP4 E2M1 per element, float32 / MX scale (ratio: torch reference / "
              "kernel)")
        print(f"{'n':>9} {'thr':>3} {'reference ns':>12} {'kernel ns':>9} {'ratio':>6}   rounding alone: "
              f"{'reference ns':>12} {'kernel ns':>9} {'ratio':>6}")
        for r in bench_fp4(sizes, threads, max(3, repeats // 3)):
            print(f"{r['n']:>9} {r['threads']:>3} {r['ref_ns']:>12.3f} {r['keyinit_ns']:>9.3f} {r['ratio']:>6.2f}"
                  f"   {'':>16}{r['ref_round_ns']:>12.3f} {r['round_ns']:>9.3f} {r['round_ratio']:>6.2f}")
    if args.only == "compiled":
        print("\n5. torch.compile(opt.step) (inductor) of AdamW, bf16 MLP (ratio: keyed / compiled torch AdamW on bf16)")
        for r in bench_compiled(threads, repeats):
            print(f"threads {r['threads']}: keyed SR fused=False {r['keyed_ms']:.2f} ms (ratio "
                  f"{r['keyed_ms'] / r['plain_ms']:.3f}), fused=True {r['fused_ms']:.2f} ms (ratio "
                  f"{r['fused_ms'] / r['plain_ms']:.3f}), compiled torch AdamW on bf16 {r['plain_ms']:.2f} ms")
        return
    if args.only in (None, "torchao"):
        try:
            import torchao.optim  # noqa: F401
        except ImportError:
            print("\n3. torchao is not installed: skipped")
            return
        print("\n3. one torchao _AdamW(bf16_stochastic_round=True) step, bf16 MLP (ratio: keyed / torchao's own)")
        for r in bench_torchao(threads, repeats):
            print(f"threads {r['threads']}: keyed {r['keyed_ms']:.2f} ms, torchao's own SR {r['own_ms']:.2f} ms: "
                  f"ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
