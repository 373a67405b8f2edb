"""Keyed dropout against torch's F.dropout, measured in the same run.

    python benchmarks/bench_dropout.py                 # CPU: (8, 1024, 1024), fp32 and bf16, 1 and 2 threads
    python benchmarks/bench_dropout.py --quick         # (8, 512, 1024), fewer repeats
    python benchmarks/bench_dropout.py --device cuda   # CUDA: (8, 4096, 4096) bf16 and fp32 (needs a GPU + triton)
    python benchmarks/bench_dropout.py --device cuda --stream v2 --only ops   # stream v2's names (docs/spec.md 14.8)

Sections (every ratio is torch time / keyinit time, so > 1 means keyinit is faster):

1. forward: ``F.dropout(x, p, True)`` vs ``keyinit.nn.functional.dropout(x, p, rng_key=key)``;
2. forward+backward: the same with ``x.requires_grad_()`` and ``y.backward(g)``;
3. activation memory: bytes each saves for backward (measured with
   ``torch.autograd.graph.saved_tensors_hooks``), per dropout call;
4. keyed overhead (CPU): a small Llama-like model's forward+backward under
   ``keyinit.nn.keyed`` vs the same model with torch's dropout (dim 256; dim 16, where compute is
   negligible, with the unkeyed model on keyinit's dropout op as a reference; and compiled:
   ``torch.compile`` vs ``keyinit.nn.compile``, at both sizes);
5. attention dropout: ``F.scaled_dot_product_attention(q, k, v, dropout_p=p)``
   (torch picks its kernel) vs ``keyinit.nn.functional.scaled_dot_product_attention``
   with the same ``dropout_p``, forward+backward, and the bytes each saves for backward;
6. keyed rows per stream version (CPU): the dropout a keyed forward applies to an activation
   ``(B, L, 256)`` (``keyinit.nn.functional.dropout_rows``: stream v1's row-major names, stream v2's
   extent-free ones, docs/spec.md 14.8) vs ``F.dropout``, forward and forward+backward;
7. a keyed random op per stream version (CPU): ``torch.randn_like(x)`` of an ``(8, 128, 256)``
   activation in a keyed forward (v1 and v2) vs the same forward unkeyed (torch's generator), in wall
   time and in this thread's CPU time.

Sections 4, 6 and 7 measure the stream versions given by ``--stream`` (default both, alternating call by
call with torch's in one run, so the v2/v1 ratio is of the same machine load):

    python benchmarks/bench_dropout.py --only attention   # section 5 alone
    python benchmarks/bench_dropout.py --only rows        # section 6 alone (--only randop: section 7)
    python benchmarks/bench_dropout.py --only model --stream v2

``--stream v2``: keyinit's dropouts in sections 1-3 and 5 name the elements as a keyed forward of stream
v2 does (``keyinit.nn.functional.dropout_rows`` and the keyed attention's ``probs_drop``, dimension 0 the
batch: docs/spec.md 14.8's extent-free names, which the kernels take as high counter words); ``v1`` and
``both`` (the default), the whole tensor's row-major indices (``keyinit.nn.functional.dropout`` and
``scaled_dot_product_attention``).

Timings alternate torch and keyinit call by call (so both see the same machine
load) and report the MEDIAN of the repeats. ``p = 0.1``. This is not a test.
``run(...)`` returns the results as a dict (for benchmarks/bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import keyinit  # noqa: E402
from keyinit.nn import dropout_key  # noqa: E402
from keyinit.nn import functional as KF  # noqa: E402
from keyinit.nn._ops.attention import attend  # noqa: E402

KEY = dropout_key(1234, step=0, fqn="layers.0.attention", ordinal=0)
#: The same key in stream v2 (``--stream v2``).
KEYS = {"v1": KEY, "v2": dropout_key(keyinit.key(1234, stream="v2"), step=0, fqn="layers.0.attention", ordinal=0)}
P = 0.1


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_pair(peer, mine, repeats: int, device: str) -> tuple[float, float]:
    """Median wall times of ``peer`` and ``mine``, called alternately after one warm-up each."""
    peer_time, mine_time = median_all((peer, mine), repeats, device, rotate=False)
    return peer_time, mine_time


def median_all(fns, repeats: int, device: str, rotate: bool = True, clock=time.perf_counter) -> list[float]:
    """Median wall times of each of ``fns``, called in turn (one round after another) after one warm-up each.

    ``rotate``: round ``r`` starts at ``fns[r % len(fns)]``, so each takes every place in the order equally
    often (the call right after torch's dropout of a large tensor pays for pages torch gave back: on the
    CPU, 8 MiB outputs measured 10.9 ms there and 1.8 ms elsewhere). ``clock``: ``time.thread_time`` for
    this thread's CPU time (which other jobs on the machine move far less than wall time)."""
    for fn in fns:
        fn()
    _sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        first = r % len(fns) if rotate else 0
        for i in (*range(first, len(fns)), *range(first)):
            _sync(device)
            start = clock()
            fns[i]()
            _sync(device)
            times[i].append(clock() - start)
    return [statistics.median(t) for t in times]


def stream_key(stream: str):
    """:data:`KEY`'s dropout key under stream version ``stream``."""
    return dropout_key(keyinit.key(1234, stream=stream), step=0, fqn="layers.0.attention", ordinal=0)


def saved_bytes(fn, x: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn(x)`` runs (a storage saved twice counts once)."""
    total = 0
    seen: set = set()

    def pack(t):
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return total


def keyinit_dropout(x: torch.Tensor, key=KEY) -> torch.Tensor:
    """keyinit's dropout of ``x`` under ``key``: the whole tensor's indices (v1), a keyed forward's names
    with dimension 0 the batch (v2)."""
    if key.stream == "v1":
        return KF.dropout(x, P, rng_key=key)
    return KF.dropout_rows(x, P, key, 0)


def bench_ops(shape, dtypes, threads_list, repeats: int, device: str, stream: str = "v1") -> list[dict]:
    key = KEYS[stream]
    rows = []
    for threads in threads_list:
        if device == "cpu":
            torch.set_num_threads(threads)
        for dtype in dtypes:
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(shape, generator=g, device=device).to(dtype)
            grad = torch.randn(shape, generator=g, device=device).to(dtype)

            def fwd_torch():
                return F.dropout(x, P, True)

            def fwd_keyinit():
                return keyinit_dropout(x, key)

            def both_torch():
                xr = x.detach().requires_grad_()
                F.dropout(xr, P, True).backward(grad)

            def both_keyinit():
                xr = x.detach().requires_grad_()
                keyinit_dropout(xr, key).backward(grad)

            fwd = median_pair(fwd_torch, fwd_keyinit, repeats, device)
            both = median_pair(both_torch, both_keyinit, repeats, device)
            xr = x.detach().requires_grad_()
            rows.append({
                "device": device, "threads": threads if device == "cpu" else None, "dtype": str(dtype)[6:],
                "stream": stream,
                "shape": list(shape),
                "fwd_torch_ms": fwd[0] * 1e3, "fwd_keyinit_ms": fwd[1] * 1e3, "fwd_ratio": fwd[0] / fwd[1],
                "fwdbwd_torch_ms": both[0] * 1e3, "fwdbwd_keyinit_ms": both[1] * 1e3,
                "fwdbwd_ratio": both[0] / both[1],
                "saved_torch_bytes": saved_bytes(lambda t: F.dropout(t, P, True), xr),
                "saved_keyinit_bytes": saved_bytes(lambda t: keyinit_dropout(t, key), xr),
                "input_bytes": x.numel() * x.element_size(),
            })
    return rows


def bench_keyed_model(repeats: int, threads: int, dim: int = 256, batch: tuple[int, int] = (8, 128),
                      compiled: bool = False, functional: bool = False, streams: tuple[str, ...] = ("v1",)) -> dict:
    """Forward+backward of a small Llama-like model: torch dropout vs the same model under keyed().

    ``streams``: the model under ``keyed(..., stream=s)`` for each, alternating call by call with torch's
    (``keyed_ms``/``ratio`` are the first stream's; ``by_stream`` has each one's).

    ``dim=16, batch=(2, 8)`` makes the compute negligible: what remains is keyed()'s per-call overhead.
    ``compiled``: torch's dropout runs ``torch.compile(model)``, the keyed one
    ``keyinit.nn.compile(model)`` (both inductor), a new step every call (so a recompilation per step
    would show), after a warm-up that compiles.
    ``functional``: also time the model without keyed but with every ``F.dropout`` call (``nn.Dropout``'s
    included) answered by ``keyinit.nn.functional.dropout`` under one fixed key, against torch's dropout
    again: the share of keyed's time that is keyinit's dropout op itself.
    """
    from torch import nn

    torch.set_num_threads(threads)

    class Block(nn.Module):
        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
            self.drop = nn.Dropout(P)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            w = F.dropout((q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5).softmax(-1), P, self.training)
            x = x + self.drop(self.proj((w @ v).transpose(1, 2).reshape(b, t, d)))
            return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))

    model = nn.Sequential(*[Block(dim, 4) for _ in range(4)]).train()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*batch, dim, generator=g)

    plain_model = torch.compile(model) if compiled else model
    keyed_model = keyinit.nn.compile(model) if compiled else model
    steps = iter(range(1 << 62))

    def plain():
        plain_model(x).sum().backward()

    def keyed_in(stream: str):
        def keyed():
            with keyinit.nn.keyed(keyed_model, 0, step=next(steps), stream=stream):
                keyed_model(x).sum().backward()
        return keyed

    keyed_fns = [keyed_in(stream) for stream in streams]
    if compiled:
        plain(), [keyed() for keyed in keyed_fns]  # compile once, outside the timings
    t_plain, *t_keyed = median_all([plain, *keyed_fns], repeats, "cpu")
    result = {"model": f"4 blocks, dim {dim}, batch {batch}" + (", compiled" if compiled else ""),
              "threads": threads, "torch_ms": t_plain * 1e3, "keyed_ms": t_keyed[0] * 1e3,
              "ratio": t_plain / t_keyed[0], "stream": streams[0],
              "by_stream": {stream: {"keyed_ms": t * 1e3, "ratio": t_plain / t} for stream, t in zip(streams, t_keyed)}}
    if functional:
        from unittest import mock

        def keyinit_dropout(input, p=0.5, training=True, inplace=False):
            return KF.dropout(input, p, rng_key=KEY) if training and p else input

        def op_only():
            with mock.patch.object(F, "dropout", keyinit_dropout):
                plain()

        t_torch, t_op = median_pair(plain, op_only, repeats, "cpu")
        result.update({"op_torch_ms": t_torch * 1e3, "op_keyinit_ms": t_op * 1e3})
    return result


def bench_attention(shape, dtype, repeats: int, device: str, threads: int | None, stream: str = "v1") -> dict:
    """SDPA with dropout: torch's vs keyinit's (keyed), forward and forward+backward."""
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    b, h, length, e = shape
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(shape, generator=g, device=device).to(dtype) for _ in range(4))

    def torch_fwd(q=q, k=k, v=v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=P)

    def keyinit_fwd(q=q, k=k, v=v):
        if stream == "v1":
            return KF.scaled_dot_product_attention(q, k, v, dropout_p=P, rng_key=KEY)
        # what a keyed forward of stream v2 runs (keyinit.nn._forward.intercept): the probabilities named by sample
        return attend(q, k, v, None, False, None, False, KF.probs_drop(P, KEYS[stream], None, 0))[0]

    def both(fn):
        def run_both():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            fn(*inputs).backward(grad)
        return run_both

    def saved(fn) -> int:
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        return saved_bytes(lambda _: fn(*inputs), q)

    fwd = median_pair(torch_fwd, keyinit_fwd, repeats, device)
    fb = median_pair(both(torch_fwd), both(keyinit_fwd), repeats, device)
    return {"device": device, "threads": threads, "dtype": str(dtype)[6:], "shape": list(shape), "stream": stream,
            "fwd_torch_ms": fwd[0] * 1e3, "fwd_keyinit_ms": fwd[1] * 1e3, "fwd_ratio": fwd[0] / fwd[1],
            "fwdbwd_torch_ms": fb[0] * 1e3, "fwdbwd_keyinit_ms": fb[1] * 1e3, "fwdbwd_ratio": fb[0] / fb[1],
            "saved_torch_bytes": saved(torch_fwd), "saved_keyinit_bytes": saved(keyinit_fwd),
            "probs_bytes": b * h * length * length * torch.finfo(dtype).bits // 8}


def bench_rows(shape, dtypes, streams: tuple[str, ...], repeats: int, threads: int) -> list[dict]:
    """The dropout of a keyed forward's activation (``dropout_rows``, row ``r`` = sample ``r``) under each
    stream version vs ``F.dropout``, forward and forward+backward, alternating call by call."""
    from keyinit.nn.functional import dropout_rows

    torch.set_num_threads(threads)
    rows = []
    for dtype in dtypes:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(shape, generator=g).to(dtype)
        grad = torch.randn(shape, generator=g).to(dtype)
        keys = [stream_key(stream) for stream in streams]

        def fwd_torch():
            return F.dropout(x, P, True)

        def both_torch():
            xr = x.detach().requires_grad_()
            F.dropout(xr, P, True).backward(grad)

        def fwd_keyed(key):
            return lambda: dropout_rows(x, P, key, 0)

        def both_keyed(key):
            def both():
                xr = x.detach().requires_grad_()
                dropout_rows(xr, P, key, 0).backward(grad)
            return both

        fwd = median_all([fwd_torch, *(fwd_keyed(k) for k in keys)], repeats, "cpu")
        both = median_all([both_torch, *(both_keyed(k) for k in keys)], repeats, "cpu")
        rows.append({"threads": threads, "dtype": str(dtype)[6:], "shape": list(shape),
                     "fwd_torch_ms": fwd[0] * 1e3, "fwdbwd_torch_ms": both[0] * 1e3,
                     "by_stream": {s: {"fwd_ms": f * 1e3, "fwd_ratio": fwd[0] / f, "fwdbwd_ms": b * 1e3,
                                       "fwdbwd_ratio": both[0] / b} for s, f, b in zip(streams, fwd[1:], both[1:])}})
    return rows


def bench_random_op(streams: tuple[str, ...], repeats: int, threads: int, shape=(8, 128, 256)) -> dict:
    """``torch.randn_like(x)`` in a keyed forward under each stream version vs the same forward unkeyed."""
    from torch import nn

    torch.set_num_threads(threads)

    class Noise(nn.Module):
        def forward(self, x):
            return torch.randn_like(x)

    net = Noise()
    x = torch.zeros(shape)
    steps = iter(range(1 << 62))

    def plain():
        net(x)

    def keyed_in(stream: str):
        def keyed():
            with keyinit.nn.keyed(net, 0, step=next(steps), stream=stream):
                net(x)
        return keyed

    fns = [plain, *(keyed_in(s) for s in streams)]
    t_plain, *t_keyed = median_all(fns, repeats, "cpu")
    c_plain, *c_keyed = median_all(fns, repeats, "cpu", clock=time.thread_time)
    return {"op": f"torch.randn_like of {tuple(shape)}", "threads": threads, "torch_ms": t_plain * 1e3,
            "torch_cpu_ms": c_plain * 1e3,
            "by_stream": {s: {"keyed_ms": t * 1e3, "ratio": t_plain / t, "keyed_cpu_ms": c * 1e3,
                              "cpu_ratio": c_plain / c} for s, t, c in zip(streams, t_keyed, c_keyed)}}


def run(device: str = "cpu", quick: bool = False, repeats: int | None = None, only: str | None = None,
        streams: tuple[str, ...] = ("v1", "v2")) -> dict:
    stream = streams[0]  # sections 1-3 and 5: one version's names
    if device == "cuda":
        shape, dtypes, threads_list = (8, 4096, 4096), (torch.bfloat16, torch.float32), (None,)
        repeats = repeats or 20
    else:
        shape = (8, 512, 1024) if quick else (8, 1024, 1024)
        dtypes, threads_list = (torch.float32, torch.bfloat16), (1, 2)
        repeats = repeats or (5 if quick else 9)
    before = torch.get_num_threads()
    try:
        result = {}
        if only in (None, "ops"):
            result["ops"] = bench_ops(shape, dtypes, threads_list, repeats, device, stream)
        if device == "cpu" and only in (None, "model"):
            result["keyed_model"] = bench_keyed_model(repeats, 1, streams=streams)
            result["keyed_overhead"] = bench_keyed_model(max(repeats, 50), 1, dim=16, batch=(2, 8), functional=True,
                                                         streams=streams)
            result["keyed_compiled"] = bench_keyed_model(repeats, 1, compiled=True, streams=streams)
            result["keyed_compiled_overhead"] = bench_keyed_model(max(repeats, 50), 1, dim=16, batch=(2, 8),
                                                                  compiled=True, streams=streams)
        if device == "cpu" and only in (None, "rows"):
            result["rows"] = bench_rows((8, 512, 256) if quick else (8, 1024, 256), (torch.float32, torch.bfloat16),
                                        streams, repeats, 1)
        if device == "cpu" and only in (None, "randop"):
            result["random_op"] = bench_random_op(streams, max(repeats, 21), 1)
        if only in (None, "attention"):
            attention_shape = (8, 8, 1024, 64) if device == "cuda" else (4, 8, 256, 64)
            result["attention"] = [bench_attention(attention_shape, dtype, repeats, device, 1 if device == "cpu" else None,
                                                   stream)
                                   for dtype in (torch.float32, torch.bfloat16)]
    finally:
        torch.set_num_threads(before)
    result["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                         "torch": torch.__version__, "keyinit": keyinit.__version__,
                         "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    return result


def print_report(result: dict) -> None:
    print(f"machine: {result['machine']}")
    if "ops" in result:
        _print_ops(result)
    for name in ("keyed_model", "keyed_overhead", "keyed_compiled", "keyed_compiled_overhead"):
        if name in result:
            m = result[name]
            keyed = ", ".join(f"keyed {s} {r['keyed_ms']:.2f} ms ({r['ratio']:.2f}x)"
                              for s, r in m.get("by_stream", {m.get("stream", "v1"): m}).items())
            print(f"\nkeyed() on a model ({m['model']}, {m['threads']} thread), forward+backward: torch dropout "
                  f"{m['torch_ms']:.2f} ms, {keyed}{_v2_over_v1(m)}")
            if "op_keyinit_ms" in m:
                print(f"  the same model unkeyed with keyinit.nn.functional.dropout in place of F.dropout (the op "
                      f"alone): torch dropout {m['op_torch_ms']:.2f} ms, keyinit's {m['op_keyinit_ms']:.2f} ms")
    for r in result.get("rows", []):
        per = "; ".join(f"{s} forward {b['fwd_ms']:.2f} ms ({b['fwd_ratio']:.2f}x), forward+backward "
                        f"{b['fwdbwd_ms']:.2f} ms ({b['fwdbwd_ratio']:.2f}x)" for s, b in r["by_stream"].items())
        print(f"\nkeyed rows dropout (dropout_rows) {r['dtype']} {tuple(r['shape'])}, {r['threads']} thread: torch "
              f"F.dropout forward {r['fwd_torch_ms']:.2f} ms, forward+backward {r['fwdbwd_torch_ms']:.2f} ms; {per}")
    if "random_op" in result:
        m = result["random_op"]
        keyed = ", ".join(f"keyed {s} {r['keyed_ms']:.2f} ms ({r['ratio']:.2f}x)" for s, r in m["by_stream"].items())
        print(f"\na keyed random op ({m['op']}, {m['threads']} thread) in a keyed forward: unkeyed torch "
              f"{m['torch_ms']:.2f} ms, {keyed}{_v2_over_v1(m)}")
        if "torch_cpu_ms" in m:
            by = m["by_stream"]
            keyed = ", ".join(f"keyed {s} {r['keyed_cpu_ms']:.2f} ms ({r['cpu_ratio']:.2f}x)" for s, r in by.items())
            cpu = f"; v2 vs v1 {by['v1']['keyed_cpu_ms'] / by['v2']['keyed_cpu_ms']:.2f}x" if {"v1", "v2"} <= set(by) else ""
            print(f"  the same in this thread's CPU time (separate rounds): unkeyed torch {m['torch_cpu_ms']:.2f} ms, "
                  f"{keyed}{cpu}")
    for r in result.get("attention", []):
        print(f"\nattention dropout {r['device']} {r['dtype']} stream {r['stream']} (B, H, L, E) = {tuple(r['shape'])}, threads "
              f"{r['threads'] or '-'}: forward torch SDPA {r['fwd_torch_ms']:.2f} ms, keyinit {r['fwd_keyinit_ms']:.2f} ms"
              f" ({r['fwd_ratio']:.2f}x); forward+backward {r['fwdbwd_torch_ms']:.2f} / {r['fwdbwd_keyinit_ms']:.2f} ms"
              f" ({r['fwdbwd_ratio']:.2f}x); saved for backward: torch {r['saved_torch_bytes'] / 2**20:.1f} MiB, keyinit"
              f" {r['saved_keyinit_bytes'] / 2**20:.1f} MiB (one probability matrix: {r['probs_bytes'] / 2**20:.1f} MiB)")


def _v2_over_v1(m: dict) -> str:
    """``; v2/v1 ...`` (v1's time over v2's: > 1 means v2 is faster) where both streams were measured."""
    by = m.get("by_stream", {})
    if "v1" in by and "v2" in by:
        return f"; v2 vs v1 {by['v1']['keyed_ms'] / by['v2']['keyed_ms']:.2f}x"
    return ""


def _print_ops(result: dict) -> None:
    print(f"\nkeyinit's element names: stream {result['ops'][0]['stream'] if result['ops'] else '-'}")
    print(f"{'device':6} {'thr':>3} {'dtype':8} {'shape':16} {'fwd torch':>10} {'fwd keyinit':>11} {'ratio':>6}"
          f" {'f+b torch':>10} {'f+b keyinit':>11} {'ratio':>6}")
    for r in result["ops"]:
        print(f"{r['device']:6} {str(r['threads'] or '-'):>3} {r['dtype']:8} {str(tuple(r['shape'])):16}"
              f" {r['fwd_torch_ms']:8.2f}ms {r['fwd_keyinit_ms']:9.2f}ms {r['fwd_ratio']:5.2f}x"
              f" {r['fwdbwd_torch_ms']:8.2f}ms {r['fwdbwd_keyinit_ms']:9.2f}ms {r['fwdbwd_ratio']:5.2f}x")
    print("\nsaved for backward per dropout call (measured with saved_tensors_hooks):")
    seen = set()
    for r in result["ops"]:
        if r["dtype"] in seen:
            continue
        seen.add(r["dtype"])
        print(f"  {r['dtype']:8} input {r['input_bytes'] / 2**20:7.1f} MiB: torch {r['saved_torch_bytes'] / 2**20:7.1f}"
              f" MiB, keyinit {r['saved_keyinit_bytes'] / 2**20:7.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="smaller CPU shape, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--only", choices=("ops", "model", "attention", "rows", "randop"), default=None,
                        help="run one section: ops (1-3), model (4), attention (5), rows (6) or randop (7)")
    parser.add_argument("--stream", choices=("v1", "v2", "both"), default="both",
                        help="the stream versions of sections 4, 6 and 7 (default both, in one run); of sections "
                             "1-3 and 5 the first (both: v1; v2: a keyed forward's names, docs/spec.md 14.8)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")
    streams = ("v1", "v2") if args.stream == "both" else (args.stream,)
    result = run(args.device, args.quick, args.repeats, args.only, streams)
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
