"""A GPT-2-small-sized bf16 training step: plain torch, keyed eager, and compiled, measured in one run.

    python benchmarks/bench_gpt2_step.py                # CUDA: GPT-2 small (12 x 768, vocab 50257), (8, 1024) tokens
    python benchmarks/bench_gpt2_step.py --dry-run      # the same code on the CPU with a tiny model (numbers mean nothing)

Each variant trains the same HF ``GPT2LMHeadModel`` (built from a config, no hub; bf16 parameters;
dropout 0.1 on embeddings, residuals and attention; SDPA attention) with AdamW on the same batch:

1. ``plain``: torch's own dropout (the global RNG), eager;
2. ``keyed``: the step's forward inside ``keyinit.nn.keyed(model, seed, step=...)``, eager;
3. ``compiled``: ``torch.compile(model)``, torch's dropout;
4. ``keyed-compiled``: ``keyinit.nn.compile(model)`` inside ``keyed``;
5. ``sr-fused`` / ``sr`` (not run unless named in ``--variants``): ``plain``'s forward, the optimizer step
   under ``keyinit.optim.stochastic_rounding(..., fused=True)`` (17.6's one-pass step: one launch per
   parameter dtype on CUDA) / ``fused=False`` (a float32 step rounded stochastically).

Reported: the median step time over the timed steps (after warm-up steps, which include compilation),
each variant's ratio against ``plain`` (plain time / variant time: > 1 means faster), and the peak
device memory of the variant's steps. Variants alternate step by step so both see the same machine
state. This is not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import keyinit.nn as knn  # noqa: E402


def build(dry: bool, device: str):
    from tests._support.vision import define_torchvision_schemas

    define_torchvision_schemas()  # a CUDA torchvision wheel beside CPU torch (transformers imports it)
    from transformers import GPT2Config, GPT2LMHeadModel

    if dry:
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128)
    else:
        config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.1
    config._attn_implementation = "sdpa"
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
    model.to(device=device, dtype=torch.bfloat16).train()
    return model, config, gen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default="plain,keyed,compiled,keyed-compiled")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    batch = args.batch or (2 if args.dry_run else 8)
    seq = args.seq or (32 if args.dry_run else 1024)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    base, config, gen = build(args.dry_run, device)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device)

    variants = {}
    for name in args.variants.split(","):
        model, _, _ = build(args.dry_run, device)
        model.load_state_dict(state)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        if name.startswith("sr"):
            import keyinit.optim

            keyinit.optim.stochastic_rounding(opt, 1234, names=model, fused=name == "sr-fused")
        if name == "compiled":
            runner = torch.compile(model)
        elif name == "keyed-compiled":
            runner = knn.compile(model)
        else:
            runner = model
        variants[name] = {"model": model, "runner": runner, "opt": opt, "times": [], "step": 0, "peak": 0}

    def step(v: dict, name: str) -> float:
        sync()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if name.startswith("keyed"):
            with knn.keyed(v["runner"], 1234, step=v["step"]):
                out = v["runner"](input_ids=ids, labels=ids)
        else:
            out = v["runner"](input_ids=ids, labels=ids)
        out.loss.backward()
        v["opt"].step()
        v["opt"].zero_grad(set_to_none=True)
        sync()
        elapsed = time.perf_counter() - t0
        v["step"] += 1
        if device == "cuda":
            v["peak"] = max(v["peak"], torch.cuda.max_memory_allocated())
        v["loss"] = float(out.loss.detach())
        return elapsed

    for i in range(args.warmup + args.steps):
        order = list(variants) if i % 2 == 0 else list(reversed(variants))
        for name in order:
            t = step(variants[name], name)
            print(f"  step {i} {name}: {t * 1e3:.1f} ms", flush=True)
            if i >= args.warmup:
                variants[name]["times"].append(t)

    plain = statistics.median(variants["plain"]["times"]) if "plain" in variants else None
    rows = {}
    print(f"GPT-2 {'(dry run, tiny)' if args.dry_run else 'small'} bf16 training step, batch {batch} x {seq} tokens, "
          f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    for name, v in variants.items():
        med = statistics.median(v["times"])
        ratio = plain / med if plain else float("nan")
        rows[name] = {"ms": med * 1e3, "vs_plain": ratio, "peak_GiB": v["peak"] / 2**30, "last_loss": v["loss"]}
        print(f"  {name:15s} {med * 1e3:9.2f} ms/step  {ratio:5.2f}x plain  peak {v['peak'] / 2**30:6.2f} GiB  "
              f"loss {v['loss']:.4f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
