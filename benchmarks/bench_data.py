"""keyinit.data against its peers, measured in the same run.

    python benchmarks/bench_data.py --grain-python /path/to/venv-with-grain/bin/python
    python benchmarks/bench_data.py --quick          # smaller sizes, fewer repeats
    python benchmarks/bench_data.py --device cuda    # section 1 on a GPU (Triton kernel; needs triton)

Sections:

1. ``permutation(key, 10**9, range(2**24))`` vs ``torch.randperm(2**24)`` (per element) and vs
   Grain 0.2.18's ``index_shuffle`` called per index through Python (the way a Grain sampler
   calls it; measured on ``--grain-indices`` indices, in a subprocess of ``--grain-python``
   because grain lives in its own environment; ``grain`` importable here is used directly).
2. The first batch (4096 positions) of ``n = 10**12``: latency, and the memory it needs
   (the output; ``randperm(10**12)`` would need 8 TB and cannot run).
3. A DataLoader epoch over a trivial dataset (``dataset[i] = i``, batch 256, ``num_workers=0``):
   ``KeyedSampler`` vs torch's ``RandomSampler`` (``shuffle=True``) and ``SequentialSampler``;
   and each sampler alone, kept (``list(sampler)``: every item alive at once) and consumed
   (iterated and dropped, as a DataLoader does: its time over the epoch's is its share of it);
   and ``DataLoader(batch_sampler=KeyedSampler(...).batch_sampler())`` vs ``SequentialSampler``.
4. ``keyed_samples``: the time per sample of the dataset's own randomness, unkeyed vs keyed, on
   one thread: one ``torch.rand(4)``, and a ``torchvision.transforms.v2`` ImageNet-style pipeline
   (RandomResizedCrop 256->224, flip, ColorJitter, RandAugment, RandomErasing) when torchvision imports.
5. Issue 25's cost targets, side by side in one run, one thread: (a) ``keyed_samples`` vs the unwrapped
   ``__getitem__`` on RandomResizedCrop(224), RandomHorizontalFlip, ColorJitter, ToDtype, RandomErasing
   over a 3x256x256 uint8 image (and, for comparison, the general path: a dispatch mode seeing every op
   and a program per draw, what keyed_samples did before); (b) ``keyed_collate`` vs the plain HF
   ``DataCollatorForLanguageModeling`` per batch of 32 (a WordLevel tokenizer built in code, sequences
   of 21-50 tokens). Wall-clock and this thread's CPU time (``time.thread_time``), both medians.

Timings alternate peer and keyinit and report the MEDIAN of the repeats. This is not a test.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import keyinit  # noqa: E402
from keyinit.data import KeyedSampler, permutation  # noqa: E402

KEY = keyinit.key(1234)

_GRAIN_SNIPPET = r"""
import json, sys, time
from grain._src.python.experimental.index_shuffle.python import index_shuffle_module as m
n, count, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
f = m.index_shuffle
times = []
for _ in range(repeats):
    t = time.perf_counter()
    for i in range(count):
        f(i, max_index=n - 1, seed=1234, rounds=4)
    times.append(time.perf_counter() - t)
times.sort()
print(json.dumps({"seconds_per_index": times[len(times) // 2] / count}))
"""


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_pair(peer, mine, repeats: int, device: str = "cpu") -> tuple[float, float]:
    peer()
    mine()
    peer_times, mine_times = [], []
    for _ in range(repeats):
        for fn, times in ((peer, peer_times), (mine, mine_times)):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(peer_times), statistics.median(mine_times)


def grain_seconds_per_index(grain_python: str | None, n: int, count: int, repeats: int) -> tuple[float | None, str]:
    try:
        import grain  # noqa: F401
        python = sys.executable
    except ImportError:
        if not grain_python:
            return None, "grain is not importable here and no --grain-python was given"
        python = grain_python
    proc = subprocess.run([python, "-c", _GRAIN_SNIPPET, str(n), str(count), str(repeats)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return None, f"grain subprocess failed: {proc.stderr.strip()[-500:]}"
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('grain'))"],
                             capture_output=True, text=True).stdout.strip()
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds_per_index"], f"grain {version}"


def section1(args) -> dict:
    count = 1 << (20 if args.quick else 24)
    n = 10**9
    device = args.device
    peer_t, mine_t = median_pair(lambda: torch.randperm(count, device=device),
                                 lambda: permutation(KEY, n, range(0, count), device=device), args.repeats, device)
    grain_s, grain_what = grain_seconds_per_index(args.grain_python, n, args.grain_indices, 3)
    out = {"positions": count, "n": n, "randperm_s": peer_t, "keyinit_s": mine_t,
           "keyinit_ns_per_position": mine_t / count * 1e9, "randperm_ns_per_element": peer_t / count * 1e9,
           "vs_randperm": peer_t / mine_t, "grain": grain_what}
    if grain_s is not None:
        out["grain_ns_per_index"] = grain_s * 1e9
        out["vs_grain"] = grain_s * count / mine_t
    return out


def section2(args) -> dict:
    n, batch = 10**12, 4096
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        first = permutation(KEY, n, range(0, batch))
        times.append(time.perf_counter() - start)
    return {"n": n, "batch": batch, "first_batch_ms": statistics.median(times) * 1e3,
            "output_bytes": first.numel() * first.element_size(), "randperm_would_need_bytes": n * 8}


class _Identity(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def section3(args) -> dict:
    n, batch = (1 << 16 if args.quick else 1 << 18), 256
    data = _Identity(n)

    def epoch(sampler) -> None:
        for _ in torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler):
            pass

    g = torch.Generator().manual_seed(0)
    random_t, keyed_t = median_pair(lambda: epoch(torch.utils.data.RandomSampler(data, generator=g)),
                                    lambda: epoch(KeyedSampler(n, 0, global_batch_size=batch)), args.repeats)
    seq_t, keyed2_t = median_pair(lambda: epoch(torch.utils.data.SequentialSampler(data)),
                                  lambda: epoch(KeyedSampler(n, 0, global_batch_size=batch)), args.repeats)
    def batch_epoch(sampler) -> None:
        for _ in torch.utils.data.DataLoader(data, batch_sampler=sampler.batch_sampler()):
            pass

    seq3_t, keyed3_t = median_pair(lambda: epoch(torch.utils.data.SequentialSampler(data)),
                                   lambda: batch_epoch(KeyedSampler(n, 0, global_batch_size=batch)), args.repeats)
    alone_random, alone_keyed = median_pair(lambda: list(torch.utils.data.RandomSampler(data, generator=g)),
                                            lambda: list(KeyedSampler(n, 0, global_batch_size=batch)), args.repeats)
    alone_random2, alone_plain = median_pair(
        lambda: list(torch.utils.data.RandomSampler(data, generator=g)),
        lambda: list(KeyedSampler(n, 0, global_batch_size=batch, yield_epoch=False)), args.repeats)
    # iterated and dropped, as a DataLoader consumes it (list() above keeps all 2**18 items alive at once)
    consumed_random, consumed_keyed = median_pair(
        lambda: collections.deque(torch.utils.data.RandomSampler(data, generator=g), maxlen=0),
        lambda: collections.deque(KeyedSampler(n, 0, global_batch_size=batch), maxlen=0), args.repeats)
    return {"n": n, "batch": batch, "random_sampler_s": random_t, "keyed_sampler_s": keyed_t,
            "sampler_alone_random_s": alone_random, "sampler_alone_keyed_s": alone_keyed,
            "sampler_alone_random_s_2": alone_random2, "sampler_alone_keyed_plain_ints_s": alone_plain,
            "sampler_consumed_random_s": consumed_random, "sampler_consumed_keyed_s": consumed_keyed,
            "keyed_sampler_share_of_epoch": consumed_keyed / keyed_t,
            "added_vs_random_sampler": keyed_t / random_t - 1, "sequential_sampler_s": seq_t,
            "keyed_sampler_s_2": keyed2_t, "added_vs_sequential_sampler": keyed2_t / seq_t - 1,
            "sequential_sampler_s_3": seq3_t, "keyed_batch_sampler_s": keyed3_t,
            "batch_sampler_added_vs_sequential_sampler": keyed3_t / seq3_t - 1}


class _Augmented(torch.utils.data.Dataset):
    """One 256x256 uint8 image through a transforms.v2 ImageNet-style pipeline (or one ``torch.rand``)."""

    def __init__(self, transform) -> None:
        self.transform = transform
        self.image = (torch.arange(3 * 256 * 256) % 251).to(torch.uint8).reshape(3, 256, 256)

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int):
        return self.transform(self.image)


def section4(args) -> dict:
    """keyed_samples: the time per sample of a dataset's own randomness, unkeyed vs keyed (one thread)."""
    from keyinit.data import keyed_samples

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cases = {"one_torch_rand": (lambda image: torch.rand(4), 50 if args.quick else 200)}
    try:
        from tests._support.vision import define_torchvision_schemas

        define_torchvision_schemas()
        from torchvision.transforms import v2
    except ImportError as exc:
        cases_note = f"torchvision pipeline skipped: {exc}"
    else:
        cases_note = "RandomResizedCrop(224), RandomHorizontalFlip, ColorJitter, RandAugment, ToDtype, RandomErasing"
        cases["torchvision_v2_pipeline"] = (v2.Compose([
            v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(), v2.ColorJitter(0.4, 0.4, 0.4, 0.1),
            v2.RandAugment(), v2.ToDtype(torch.float32, scale=True), v2.RandomErasing(p=0.5)]), 5 if args.quick else 20)
    out: dict = {"pipeline": cases_note, "threads": 1}
    try:
        for name, (transform, count) in cases.items():
            plain = _Augmented(transform)
            keyed = keyed_samples(plain, 0)
            plain_t, keyed_t = median_pair(lambda: [plain[i] for i in range(count)],
                                           lambda: [keyed[(i, 0)] for i in range(count)], args.repeats)
            out[name] = {"plain_ms_per_sample": plain_t / count * 1e3, "keyed_ms_per_sample": keyed_t / count * 1e3,
                         "ratio": keyed_t / plain_t}
    finally:
        torch.set_num_threads(threads)
    return out


def median_pair_both(peer, mine, repeats: int) -> dict:
    """Medians of interleaved repeats, wall clock and this thread's CPU time (less moved by other jobs)."""
    peer()
    mine()
    times: dict = {"peer_wall": [], "mine_wall": [], "peer_cpu": [], "mine_cpu": []}
    for _ in range(repeats):
        for fn, name in ((peer, "peer"), (mine, "mine")):
            wall, cpu = time.perf_counter(), time.thread_time()
            fn()
            times[f"{name}_cpu"].append(time.thread_time() - cpu)
            times[f"{name}_wall"].append(time.perf_counter() - wall)
    return {k: statistics.median(v) for k, v in times.items()}


def _mlm_collator():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(200)]
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                      special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                  sep_token="[SEP]", mask_token="[MASK]")
    examples = [tok(" ".join(words[(i * 7) % 200:(i * 7) % 200 + 19 + i % 30])) for i in range(32)]
    return DataCollatorForLanguageModeling(tok, mlm_probability=0.15), examples


def section5(args) -> dict:
    """Issue 25's targets: keyed __getitem__ <= 1.2x, keyed_collate <= 1.5x, measured side by side."""
    from keyinit.data import KeyedBatch, keyed_collate, keyed_samples
    from keyinit._engine.keyed import intercept as _intercept
    from keyinit.data import _fast

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict = {"threads": 1, "repeats": args.repeats}
    try:
        try:
            from tests._support.vision import define_torchvision_schemas

            define_torchvision_schemas()
            from torchvision.transforms import v2
        except ImportError as exc:
            out["augment"] = f"skipped: {exc}"
        else:
            transform = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(),
                                    v2.ColorJitter(0.4, 0.4, 0.4, 0.1), v2.ToDtype(torch.float32, scale=True),
                                    v2.RandomErasing(p=0.5)])
            plain = _Augmented(transform)
            keyed = keyed_samples(plain, 0)
            count = 10 if args.quick else 40
            t = median_pair_both(lambda: [plain[i] for i in range(count)],
                                 lambda: [keyed[(i, 0)] for i in range(count)], args.repeats)
            available, plan = _intercept.available, _fast.plan
            _intercept.available = lambda: False  # the general path: dispatch mode, a program per draw
            _fast.plan = lambda *a, **k: None
            try:
                g = median_pair_both(lambda: [plain[i] for i in range(count)],
                                     lambda: [keyed[(i, 0)] for i in range(count)], max(3, args.repeats // 3))
            finally:
                _intercept.available, _fast.plan = available, plan
            out["augment"] = {
                "pipeline": "RandomResizedCrop(224), RandomHorizontalFlip, ColorJitter, ToDtype, RandomErasing",
                "plain_ms_per_sample_wall": t["peer_wall"] / count * 1e3,
                "keyed_ms_per_sample_wall": t["mine_wall"] / count * 1e3, "ratio_wall": t["mine_wall"] / t["peer_wall"],
                "plain_ms_per_sample_cpu": t["peer_cpu"] / count * 1e3,
                "keyed_ms_per_sample_cpu": t["mine_cpu"] / count * 1e3, "ratio_cpu": t["mine_cpu"] / t["peer_cpu"],
                "general_path_ratio_wall": g["mine_wall"] / g["peer_wall"],
                "general_path_ratio_cpu": g["mine_cpu"] / g["peer_cpu"]}
        try:
            collator, examples = _mlm_collator()
        except ImportError as exc:
            out["collate"] = f"skipped: {exc}"
        else:
            keyed_c = keyed_collate(collator, 0)
            batch = KeyedBatch(examples, tuple((0, i) for i in range(len(examples))))
            count = 10 if args.quick else 40
            c = median_pair_both(lambda: [collator(examples) for _ in range(count)],
                                 lambda: [keyed_c(batch) for _ in range(count)], args.repeats)
            out["collate"] = {
                "collator": "DataCollatorForLanguageModeling(mlm_probability=0.15), batch 32",
                "padded_shape": list(collator(examples)["input_ids"].shape),
                "plain_ms_per_batch_wall": c["peer_wall"] / count * 1e3,
                "keyed_ms_per_batch_wall": c["mine_wall"] / count * 1e3, "ratio_wall": c["mine_wall"] / c["peer_wall"],
                "plain_ms_per_batch_cpu": c["peer_cpu"] / count * 1e3,
                "keyed_ms_per_batch_cpu": c["mine_cpu"] / count * 1e3, "ratio_cpu": c["mine_cpu"] / c["peer_cpu"]}
    finally:
        torch.set_num_threads(threads)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--grain-python", default=None, help="a python with grain installed (for the peer)")
    parser.add_argument("--grain-indices", type=int, default=100_000)
    parser.add_argument("--only", type=int, action="append")
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, device {args.device}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    results = {}
    for number, fn in ((1, section1), (2, section2), (3, section3), (4, section4), (5, section5)):
        if args.only and number not in args.only:
            continue
        if args.device != "cpu" and number != 1:
            continue
        results[number] = fn(args)
        print(f"section {number}: " + json.dumps(results[number], indent=1), flush=True)
        print(f"# load average after section {number}: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
              flush=True)


if __name__ == "__main__":
    main()
