"""Which HF LMs and seq2seq models run a module more than once per forward with draws of its own (not a test).

For every architecture of ``tests/_support/hf_arch.lm_architectures()`` and ``seq2seq_architectures()`` that
builds from its tiny config and runs from token ids, one
keyed train forward (every dropout-like probability 0.1) is run under each numbering rule of
``keyed(..., randomness=Randomness(calls=...))`` (docs/spec.md 14.4), recording the key of every draw. Under
``calls="execution"`` (stream v1's first rule) a module's executions restart their count, so a module
run twice draws with the same keys twice; under the default ``calls="forward"`` no key may repeat.

    python benchmarks/survey_shared_keys.py
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

import keyinit.nn as knn  # noqa: E402
from tests._support.drawn_keys import keys_drawn  # noqa: E402
from tests._support.hf_arch import lm_architectures, seq2seq_architectures, tiny_config  # noqa: E402


def shared_keys(model: torch.nn.Module, inputs: dict, calls: str) -> dict[str, int]:
    """``{FQN: draws whose key an earlier draw of the forward had}`` of one keyed forward."""
    with keys_drawn() as drawn, knn.keyed(model, 0, step=0, randomness=knn.Randomness(calls=calls)):
        model(**inputs)
    seen: set = set()
    repeated: Counter = Counter()
    for _, fqn, k in drawn:
        if k in seen:
            repeated[fqn] += 1
        seen.add(k)
    return dict(repeated)


def main() -> None:
    from tests._support.vision import define_torchvision_schemas

    define_torchvision_schemas()
    ran, affected, failed = 0, {}, []
    every = [(t, c, False) for t, c in lm_architectures()] + [(t, c, True) for t, c in seq2seq_architectures()]
    for model_type, class_name, seq2seq in every:
        try:
            with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                config = tiny_config(model_type, dropout=0.1)
                cls = getattr(transformers, class_name)
                with torch.device("meta"):  # some default configs stay large: as the sweep, at most 5M elements
                    probe = cls(config)
                if sum(t.numel() for t in [*probe.parameters(), *probe.buffers()]) > 5_000_000:
                    raise MemoryError("larger than the sweep's 5M elements")
                model = cls(config).train()
                vocab = int(getattr(config, "vocab_size", None) or 64)
                ids = (torch.arange(16).reshape(2, 8) * 7 + 3) % max(vocab - 4, 2) + 4
                inputs = {"input_ids": ids}
                if seq2seq:
                    inputs["decoder_input_ids"] = ids[:, :6]
                old = shared_keys(model, inputs, "execution")
                new = shared_keys(model, inputs, "forward")
        except Exception as exc:  # noqa: BLE001 - does not build or run from input_ids, or refused
            failed.append(f"{model_type} ({type(exc).__name__})")  # (an LM and a seq2seq may share a type)
            continue
        ran += 1
        if new:
            print(f"{model_type}: keys still shared under calls='forward': {new}")
        if old:
            affected[model_type] = old
    print(f"{ran} architectures ran a keyed forward; {len(failed)} did not (no tiny build, inputs, or refused)")
    print(f"{len(affected)} drew one key twice under calls='execution' (v1's first rule):")
    for model_type, modules in sorted(affected.items()):
        print(f"  {model_type}: {modules}")


if __name__ == "__main__":
    main()
