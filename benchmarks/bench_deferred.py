"""Section 11 of benchmarks/bench.py: ``keyinit.deferred`` construction and replay (issue 13).

    python benchmarks/bench.py --only d

1. construction of an 8B Llama, HF (``LlamaForCausalLM`` from a Llama-3-8B config, its
   ``post_init`` included) and torchtitan shapes (``keyinit.cli.models.llama("llama3-8b")``):
   built under ``torch.device("meta")`` (the peer: nothing recorded) vs ``keyinit.deferred``
   (every op of the constructor recorded), median of interleaved rounds; target: deferred
   within 2x of meta;
2. memory: peak RSS growth of a fresh process doing each construction (target: nothing
   proportional to the parameters, 16 GB of fp32 here);
3. replay: a 125M HF Llama materialized from ``deferred`` vs built on meta and materialized
   with ``init_method=model._init_weights`` (issue 8's path), median of interleaved rounds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

_LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8)
_LLAMA_125M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                   num_attention_heads=12, num_key_value_heads=4, pad_token_id=0)


def _transformers():
    sys.path.insert(0, str(REPO))
    from tests._support.vision import define_torchvision_schemas  # the CUDA torchvision wheel beside CPU torch

    define_torchvision_schemas()
    import transformers

    return transformers


def builders(which: str):
    """``(meta_build, deferred_build)`` for ``which`` in ``hf8b``, ``titan8b``."""
    import keyinit

    if which == "hf8b":
        tf = _transformers()
        config = tf.LlamaConfig(**_LLAMA3_8B)

        def meta():
            with torch.device("meta"):
                return tf.LlamaForCausalLM(config)

        return meta, lambda: keyinit.deferred(tf.LlamaForCausalLM, config)
    from keyinit.cli.models import llama

    def meta_titan():
        with torch.device("meta"):
            return llama("llama3-8b")

    return meta_titan, lambda: keyinit.deferred(llama, "llama3-8b")


_MEM_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/benchmarks")
import torch, keyinit
import bench, bench_deferred
which, mode = sys.argv[2], sys.argv[3]
meta, deferred = bench_deferred.builders(which)
base = bench_deferred.peak_rss()
model = (meta if mode == "meta" else deferred)()
print(json.dumps({"delta": bench_deferred.peak_rss() - base,
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def peak_rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run(rounds: int, median_pair, table) -> None:
    import keyinit

    rows = []
    for which, label in (("hf8b", "HF LlamaForCausalLM, Llama-3-8B config"),
                         ("titan8b", "torchtitan-style llama3-8b (keyinit.cli.models)")):
        try:
            meta, deferred = builders(which)
        except ImportError as exc:
            rows.append([label, f"skipped ({exc})", "", "", ""])
            continue
        t_meta, t_deferred = median_pair(meta, deferred, rounds)
        memory = {}
        for mode in ("meta", "deferred"):
            proc = subprocess.run([sys.executable, "-c", _MEM_CHILD, str(REPO), which, mode],
                                  capture_output=True, text=True, check=True)
            memory[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        params = memory["deferred"]["params"]
        ratio = t_deferred / t_meta
        rows.append([f"{label}, {params / 1e9:.2f}B params", f"{t_meta:.3f}", f"{t_deferred:.3f}",
                     f"{ratio:.2f}x ({'met' if ratio <= 2 else 'NOT met'}: <= 2x)",
                     f"{memory['meta']['delta'] / 2**20:.0f} / {memory['deferred']['delta'] / 2**20:.0f}"])
    table(f"11a. keyinit.deferred construction vs torch.device('meta'), median of {rounds}",
          ["model", "meta s", "deferred s", "deferred / meta", "peak RSS growth MiB (meta / deferred)"], rows)

    try:
        tf = _transformers()
    except ImportError:
        return
    config = tf.LlamaConfig(**_LLAMA_125M)

    def init_method_path():
        with torch.device("meta"):
            model = tf.LlamaForCausalLM(config)
        keyinit.materialize(model, 0, device="cpu", init_method=model._init_weights)

    def deferred_path():
        model = keyinit.deferred(tf.LlamaForCausalLM, config)
        keyinit.materialize(model, 0, device="cpu")

    runs = max(3, rounds // 3)
    t_method, t_deferred = median_pair(init_method_path, deferred_path, runs)
    table(f"11b. replay: a 125M HF Llama, construction + materialize, median of {runs}",
          ["path", "seconds", "ratio (init_method / deferred)"],
          [["meta + materialize(init_method=model._init_weights)", f"{t_method:.3f}", ""],
           ["keyinit.deferred + materialize", f"{t_deferred:.3f}", f"{t_method / t_deferred:.2f}x"]])
