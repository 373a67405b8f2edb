"""``keyinit.nn.compile`` over every causal-LM and masked-LM architecture of transformers (not a test; slow).

    python benchmarks/sweep_keyed_compile.py                  # every architecture (about 12 minutes on 2 cores)
    python benchmarks/sweep_keyed_compile.py bert,opt,bart    # some

Each architecture is built from its tiny config (``tests/_support/hf_arch.py``: every dropout-like probability
0.1, LayerDrop 0), in train mode, and run under ``keyinit.nn.keyed`` eagerly and compiled by
``keyinit.nn.compile(model, backend="aot_eager")`` (dynamo and AOTAutograd over torch's own eager
kernels, so equal values are expected bit for bit) at step 0 on rows 0..3 and at step 1 on rows 2..3
(``sample_offset=2``). One line per architecture: ``equal``, ``equal (ran eagerly)`` when dynamo ran a
draw eagerly and the module became an eager keyed forward, ``DIFF`` with the largest difference, or the
error; architectures whose tiny config does not build or run eagerly, is larger than 2M elements, or
that ``torch.compile`` itself fails on (tried, with no keyinit, after a failure) are counted, not
compared.
"""

from __future__ import annotations

import collections
import os
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import tests.conftest  # noqa: E402,F401 - the torchvision shim (see tests/_support/vision.py)
import torch  # noqa: E402

import keyinit.nn as knn  # noqa: E402
from tests._support.hf_arch import lm_architectures, tiny_config  # noqa: E402

MAX_ELEMENTS = 2_000_000


def _logits(model, ids):
    out = model(input_ids=ids)
    found = getattr(out, "logits", None)
    return found if found is not None else out[0]


def check(model_type: str, class_name: str) -> str:
    import transformers

    try:
        config = tiny_config(model_type, dropout=0.1)
        if hasattr(config, "layerdrop"):
            config.layerdrop = 0.0
        cls = getattr(transformers, class_name)
        with torch.device("meta"):
            probe = cls(config)
        if sum(t.numel() for t in [*probe.parameters(), *probe.buffers()]) > MAX_ELEMENTS:
            return "skipped: large"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = cls(config).train()
        vocab = getattr(config, "vocab_size", None) or 64
        ids = (torch.arange(4 * 8).reshape(4, 8) * 7 + 3) % max(int(vocab) - 4, 2) + 4
        with knn.keyed(model, 0, step=0):
            _logits(model, ids)
    except Exception as exc:  # noqa: BLE001 - transformers' own failure on a tiny config
        return f"skipped: does not build or run eagerly ({type(exc).__name__})"
    torch._dynamo.reset()
    compiled = knn.compile(model, backend="aot_eager")
    worst = 0.0
    try:
        for step, offset, rows in [(0, 0, ids), (1, 2, ids[2:])]:
            with knn.keyed(model, 0, step=step, sample_offset=offset):
                eager = _logits(model, rows).detach()
            with knn.keyed(compiled, 0, step=step, sample_offset=offset):
                got = _logits(compiled, rows).detach()
            if not torch.equal(got, eager):
                worst = max(worst, (got - eager).abs().max().item())
    except Exception as exc:  # noqa: BLE001 - reported
        torch._dynamo.reset()
        try:  # the model under torch.compile alone, with no keyinit: does torch compile it at all?
            with torch.random.fork_rng(devices=[]):
                _logits(torch.compile(model, backend="aot_eager"), ids)
        except Exception as plain:  # noqa: BLE001 - torch's own failure
            return f"skipped: torch.compile fails without keyinit too ({type(plain).__name__})"
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if worst:
        return f"DIFF {worst:.3g}"
    return "equal (ran eagerly)" if compiled.runs_eagerly else "equal"


def main() -> None:
    only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else None
    counts: collections.Counter = collections.Counter()
    for model_type, class_name in lm_architectures():
        if only and model_type not in only:
            continue
        start = time.time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = check(model_type, class_name)
        counts[result.split(":")[0].split(" (")[0] if not result.startswith("equal") else result] += 1
        if not result.startswith("skipped"):
            print(f"{model_type:28} {result} ({time.time() - start:.1f} s)", flush=True)
    print(dict(counts))


if __name__ == "__main__":
    main()
