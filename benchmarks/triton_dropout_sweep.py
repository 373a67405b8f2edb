"""Launches of the Triton dropout kernel's rows mode (stream v2's names) against torch's F.dropout, one run.

    python benchmarks/triton_dropout_sweep.py             # CUDA: (8, 4096, 4096) bf16 and fp32 (under 60 s on an H100)
    python benchmarks/triton_dropout_sweep.py --dry-run   # CPU: Triton's interpreter, a tiny shape (checks the script)
    python benchmarks/triton_dropout_sweep.py --candidates 4096/4/16384 8192/8/16384 4096/4/16384/bits

Rows, each timed with ``triton.testing.do_bench`` (median; it flushes the L2 cache between calls):

- ``torch``: ``F.dropout(x, p, True)``; forward+backward through autograd (the peer of every ratio);
- ``op v1`` / ``op v2``: keyinit's op as a model calls it (``keyinit.nn.functional.dropout`` with the whole
  tensor's indices / ``dropout_rows``, dimension 0 the batch: v2's extent-free names), through autograd;
- ``kernel v1 run``: the kernel alone on v1's indices (its run mode), forward = one launch, forward+backward =
  two (the forward on ``x``, the backward on the gradient: what the op launches);
- ``rows T/W/E``: the kernel alone on v2's names in its rows mode under ``Tuning(tile_bytes=T, warps=W,
  elements=E)`` (tiles of T bytes: T/4 float32 or T/2 bfloat16 words; at most W warps a program; about E
  elements a program); a ``/bits``
  suffix rounds bfloat16 by integer arithmetic on the bits (``bf16_cvt=False``, the default until a GPU run
  has checked the hardware's conversion; without it, the hardware's conversion), ``/anynan`` leaves a kept NaN as the conversion gives it (``bf16_nan=False``: not
  set to the C kernel's 0x7FC0; the spec leaves a NaN's bits out); ``*`` marks ``TUNING``, what the op
  ships with.

Values: the input ``x`` holds every bfloat16 bit pattern in turn (NaNs, infinities, subnormals, -0; in
float32 those values widened, among normal draws), so the column ``bits`` checks the rounding: the op's
output (v1 and v2) must equal keyinit's C kernel's on the CPU, and every candidate's the op's, bit for bit;
a mismatch is a bug in the kernel, not a result (and the exit status is 2).

Ratios are torch's time / the row's (> 1: faster than torch). To ship another candidate, set
``keyinit._kernels.dropout.triton.TUNING`` to it. ``--json PATH`` writes the rows. This is not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # (before triton is imported: the interpreter runs the kernels on CPU tensors)
    os.environ["TRITON_INTERPRET"] = "1"
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # (numpy on the NaN inputs)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import keyinit  # noqa: E402
from keyinit._draw.dropout_geometry import rows_template, with_key  # noqa: E402
from keyinit._kernels.dropout import triton as triton_dropout  # noqa: E402
from keyinit.nn import dropout_key  # noqa: E402
from keyinit.nn import functional as KF  # noqa: E402

P = 0.1
KEYS = {stream: dropout_key(keyinit.key(1234, stream=stream), step=0, fqn="layers.0.attention", ordinal=0)
        for stream in ("v1", "v2")}
#: ``tile_bytes/warps/elements`` of the candidates timed by default (the shipped TUNING is always added).
CANDIDATES = ("4096/4/4096", "4096/4/16384", "4096/4/65536", "4096/8/16384", "8192/4/16384", "8192/8/16384",
              "16384/8/16384", "16384/16/16384", "2048/2/16384", "4096/4/16384/bits", "4096/4/16384/anynan")


def parse_config(text: str) -> triton_dropout.Tuning:
    parts = text.split("/")
    if len(parts) < 3 or not set(parts[3:]) <= {"bits", "anynan"}:
        raise SystemExit(f"--candidates: {text!r} is not tile_bytes/warps/elements[/bits][/anynan]")
    tile_bytes, warps, elements = (int(v) for v in parts[:3])
    return triton_dropout.Tuning(tile_bytes, warps, elements, bf16_cvt="bits" not in parts,
                                 bf16_nan="anynan" not in parts)


def label(config: triton_dropout.Tuning) -> str:
    return (f"{config.tile_bytes}/{config.warps}/{config.elements}" + ("" if config.bf16_cvt else "/bits")
            + ("" if config.bf16_nan else "/anynan"))


def timer(device: str, dry_run: bool):
    """``time(fn) -> milliseconds``: do_bench's median on CUDA; on the dry run a few calls' median."""
    if not dry_run:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=40, return_mode="median")

    def time_cpu(fn):
        fn()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    return time_cpu


def geometry(shape, stream: str):
    key = KEYS[stream]
    return with_key(rows_template(tuple(shape), 0, P, stream), key.k0, key.k1)


def warm_up(configs, device: str, jobs: int) -> None:
    """Compile every candidate's kernel variants in ``jobs`` processes at once (Triton's disk cache then
    serves the timed process), so compiling does not take most of the run; a failure only costs time."""
    if jobs <= 1 or device != "cuda":
        return
    import concurrent.futures
    import multiprocessing

    work = [(label(c), dtype) for c in configs for dtype in ("bfloat16", "float32")] + [("v1", "bfloat16"),
                                                                                        ("v1", "float32")]
    start = time.perf_counter()
    try:
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_compile_one, work))
    except Exception as exc:  # noqa: BLE001 - the timed run compiles what is missing
        print(f"(warm-up failed after {time.perf_counter() - start:.1f} s, compiling in the timed run: {exc})")
        return
    print(f"compiled {len(work)} kernel variants in {time.perf_counter() - start:.1f} s ({jobs} processes)")


def _compile_one(item) -> None:
    name, dtype_name = item
    dtype = getattr(torch, dtype_name)
    shape = (2, 2, 4096)  # the full shape's kernel variants: three dims (none of extent 1), rows of 4096
    x = torch.zeros(shape, dtype=dtype, device="cuda")
    if name == "v1":
        triton_dropout.run(x, torch.empty_like(x), geometry(shape, "v1"))
    else:
        triton_dropout.run(x, torch.empty_like(x), geometry(shape, "v2"), tuning=parse_config(name))
    torch.cuda.synchronize()


def special_input(shape, dtype, device: str) -> torch.Tensor:
    """Every bfloat16 bit pattern (NaN, infinities, subnormals, -0, ties of the rounding), in a scrambled
    order; float32: those values widened in the even elements, normal draws in the odd."""
    n = 1
    for size in shape:
        n *= size
    # element i: pattern 40503 * i mod 2**16 (an odd factor: each 65536 elements hold every pattern once)
    patterns = (torch.arange(n, device=device, dtype=torch.int64) * 40503).remainder(65536).to(torch.int16)
    x = patterns.view(torch.bfloat16).reshape(shape)
    if dtype == torch.bfloat16:
        return x
    draws = torch.randn(shape, generator=torch.Generator(device=device).manual_seed(0), device=device)
    flat = draws.reshape(-1)
    flat[0::2] = x.reshape(-1)[0::2].to(torch.float32)
    return flat.reshape(shape).to(dtype)


def c_dropout(x: torch.Tensor, geom) -> tuple[torch.Tensor, str]:
    """keyinit's C kernel on a CPU copy of ``x``, on x's device, and its name; without the C kernel (no
    compiler) the torch reference, whose NaNs have torch's bits (the spec leaves them out)."""
    from keyinit._draw.reference_dropout import dropout as reference
    from keyinit._kernels.dropout import cpu

    host = x.cpu()
    out = torch.empty_like(host)
    if cpu.run(host, out, geom):
        return out.to(x.device), "the C kernel"
    reference(host, out, geom)
    return out.to(x.device), "the reference"


def same(got: torch.Tensor, want: torch.Tensor, what: str, nan_bits: bool = True) -> str:
    """Bit for bit, except a kept NaN's sign and payload, which ``docs/spec.md`` 14.3 leaves out of the
    contract (a float32 signaling NaN comes out of a GPU multiply as its canonical NaN, out of the CPU's
    quieted): NaN where ``want`` is NaN, whatever its bits. ``nan_bits=True`` also reports NaN bits that
    differ (the C kernel's bfloat16 NaN, 0x7FC0, when the launch promises it)."""
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return f"DIFFER from {what} (NaN at other places)"
    values_equal = torch.equal(got.masked_fill(nan, 0).view(torch.uint8), want.masked_fill(nan, 0).view(torch.uint8))
    if not values_equal:
        differ = int((got.masked_fill(nan, 0).view(torch.uint8) != want.masked_fill(nan, 0).view(torch.uint8)).sum())
        return f"DIFFER from {what} ({differ} bytes of non-NaN values)"
    if nan_bits and what != "the reference" and not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
        return f"= {what} (NaN bits differ: outside the contract)" if got.dtype != torch.bfloat16 else \
            f"DIFFER from {what} (bfloat16 NaN bits)"
    return f"= {what}"


def sweep(shape, dtypes, configs, device: str, dry_run: bool) -> list[dict]:
    time_ms = timer(device, dry_run)
    interpret = dry_run
    shipped = triton_dropout.TUNING
    results = []
    for dtype in dtypes:
        x = special_input(shape, dtype, device)
        grad = torch.randn(shape, generator=torch.Generator(device=device).manual_seed(1), device=device).to(dtype)
        out, out_grad = torch.empty_like(x), torch.empty_like(x)
        v1, v2 = geometry(shape, "v1"), geometry(shape, "v2")
        plan = triton_dropout._plan(v2, x.numel(), x.element_size(), shipped)
        assert plan.mode == triton_dropout.ROWS, f"{shape} is not laid out in the rows mode: {plan}"

        def autograd(fn):
            def both():
                xr = x.detach().requires_grad_()
                fn(xr).backward(grad)
            return both

        def kernel(geom, tuning=None):
            def fwd():
                triton_dropout.run(x, out, geom, interpret_ok=interpret, tuning=tuning)

            def both():
                triton_dropout.run(x, out, geom, interpret_ok=interpret, tuning=tuning)
                triton_dropout.run(grad, out_grad, geom, interpret_ok=interpret, tuning=tuning)
            return fwd, both

        rows = [
            ("torch", "", lambda: F.dropout(x, P, True), autograd(lambda t: F.dropout(t, P, True)), None),
            ("op v1", "", lambda: KF.dropout(x, P, rng_key=KEYS["v1"]),
             autograd(lambda t: KF.dropout(t, P, rng_key=KEYS["v1"])), None),
            ("op v2", label(shipped), lambda: KF.dropout_rows(x, P, KEYS["v2"], 0),
             autograd(lambda t: KF.dropout_rows(t, P, KEYS["v2"], 0)), None),
            ("kernel v1 run", "", *kernel(v1), None),
        ]
        launches = configs if dtype == torch.bfloat16 else [  # (the bfloat16 flags change no other kernel)
            c for c in configs if c.bf16_cvt == shipped.bf16_cvt and c.bf16_nan == shipped.bf16_nan]
        for config in launches:
            rows.append((f"rows{'*' if config == shipped else ''}", label(config), *kernel(v2, config), config))

        c_kernel = {stream: c_dropout(x, geom) for stream, geom in (("v1", v1), ("v2", v2))}
        reference = KF.dropout_rows(x, P, KEYS["v2"], 0)
        torch_fwd = torch_both = None
        for name, config_label, fwd, both, config in rows:
            bits = ""
            if config is not None:
                out.fill_(0)
                fwd()
                bits = same(out, reference, "the op v2", config.bf16_nan or dtype != torch.bfloat16)
            elif name in ("op v1", "op v2"):
                bits = same(fwd(), *c_kernel[name[-2:]])
            elif name == "kernel v1 run":
                out.fill_(0)
                fwd()
                bits = same(out, *c_kernel["v1"])
            fwd_ms, both_ms = time_ms(fwd), time_ms(both)
            if name == "torch":
                torch_fwd, torch_both = fwd_ms, both_ms
            results.append({"dtype": str(dtype)[6:], "shape": list(shape), "row": name, "config": config_label,
                            "fwd_ms": fwd_ms, "fwd_ratio": torch_fwd / fwd_ms, "fwdbwd_ms": both_ms,
                            "fwdbwd_ratio": torch_both / both_ms, "bits": bits,
                            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"})
    return results


def report(results) -> None:
    print(f"\n{'dtype':9} {'row':14} {'config':24} {'fwd ms':>8} {'ratio':>6} {'f+b ms':>8} {'ratio':>6}  bits")
    for r in results:
        print(f"{r['dtype']:9} {r['row']:14} {r['config']:24} {r['fwd_ms']:8.3f} {r['fwd_ratio']:6.2f} "
              f"{r['fwdbwd_ms']:8.3f} {r['fwdbwd_ratio']:6.2f}  {r['bits']}")
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        candidates = [r for r in results if r["dtype"] == dtype and r["row"].startswith("rows")]
        best = min(candidates, key=lambda r: r["fwd_ms"] + r["fwdbwd_ms"])
        v1 = next(r for r in results if r["dtype"] == dtype and r["row"] == "kernel v1 run")
        print(f"{dtype}: fastest rows candidate {best['config']} (fwd {best['fwd_ms']:.3f} ms, fwd+bwd "
              f"{best['fwdbwd_ms']:.3f} ms; kernel v1 run {v1['fwd_ms']:.3f} / {v1['fwdbwd_ms']:.3f} ms)")
    if any(r["bits"].startswith("DIFFER") for r in results):
        print("AN OUTPUT DIFFERS FROM ITS REFERENCE (column bits): a bug, not a result.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, a tiny shape")
    parser.add_argument("--candidates", nargs="*", default=list(CANDIDATES),
                        help="tile_bytes/warps/elements[/bits][/anynan] each")
    parser.add_argument("--shape", type=int, nargs="+", default=None)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes compiling the kernel variants before the timed run")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.dry_run:
        device, shape = "cpu", tuple(args.shape or (2, 3, 1024))
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to check the script on the CPU")
            return 1
        device, shape = "cuda", tuple(args.shape or (8, 4096, 4096))
    configs = list(dict.fromkeys([triton_dropout.TUNING] + [parse_config(c) for c in args.candidates]))
    warm_up(configs, device, args.jobs)
    results = sweep(shape, [getattr(torch, d) for d in args.dtypes], configs, device, args.dry_run)
    report(results)
    print(f"\n{shape}, p={P}, torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{results[0]['device']}; {time.perf_counter() - start:.1f} s in all")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 2 if any(r["bits"].startswith("DIFFER") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
