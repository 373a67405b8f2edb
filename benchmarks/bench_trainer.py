"""An HF ``Trainer`` step keyed by ``keyed_trainer`` against the plain ``Trainer``'s, measured in one run.

    python benchmarks/bench_trainer.py                   # BERT MLM, hidden 256, 4 layers, batch 16 x <= 128 tokens
    python benchmarks/bench_trainer.py --dim 512 --layers 6

Both variants train the same ``BertForMaskedLM`` (built from a config, no hub; hidden and attention dropout 0.1;
SDPA attention) from the same weights, with ``DataCollatorForLanguageModeling`` (dynamic padding) over the
same variable-length samples and the same ``TrainingArguments`` (AdamW, one process, the CPU unless CUDA is
there). ``keyed`` is the same Trainer after ``keyed_trainer(trainer)``: KeyedSampler, keyed collate (MLM
masks), every training forward inside ``keyinit.nn.keyed``.

A step is the time from the Trainer's ``on_step_begin`` to its ``on_step_end`` callback: the micro-batches'
loading and collating, forward, backward and the optimizer step. Each round runs the two variants, in
alternating order, for ``--warmup`` + ``--steps`` steps each; the report is the median step of each variant
over all rounds' timed steps and their ratio (keyed / plain: below 1.1 is the target of issue 37). This is
not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests._support.vision import define_torchvision_schemas  # noqa: E402

define_torchvision_schemas()  # a CUDA torchvision wheel beside CPU torch (transformers imports it)

import transformers  # noqa: E402

import keyinit  # noqa: E402
from keyinit.integrations.transformers import keyed_trainer  # noqa: E402
from tests._support.words import SPECIAL, WordTokenizer  # noqa: E402

class _Texts(torch.utils.data.Dataset):
    """``n`` samples of 16 to ``length`` tokens: [CLS], words, [SEP]."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.n, self.length, self.vocab = n, length, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        words = 14 + (i * 37) % (self.length - 15)
        return {"input_ids": [2] + [5 + (i * 131 + 17 * j) % (self.vocab - 5) for j in range(words)] + [3]}


class _Clock(transformers.TrainerCallback):
    """Each step's time: wall-clock, or this process's CPU time (``--clock cpu``: on a machine that other
    work loads, the time the step spent on a core, not the time it waited for one)."""

    def __init__(self, clock: str) -> None:
        self.times: list = []
        self.now = time.process_time if clock == "cpu" else time.perf_counter

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._t0 = self.now()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(self.now() - self._t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time a step (a loaded machine; DataLoader workers not counted)")
    args = parser.parse_args()
    vocab = 1000
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=args.dim, num_hidden_layers=args.layers,
                                     num_attention_heads=max(1, args.dim // 64), intermediate_size=4 * args.dim,
                                     max_position_embeddings=args.length, hidden_dropout_prob=0.1,
                                     attention_probs_dropout_prob=0.1)
    model = keyinit.deferred(transformers.BertForMaskedLM, config)
    keyinit.materialize(model, 0, device="cpu")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    tokenizer = WordTokenizer(words=vocab - len(SPECIAL))
    data = _Texts(args.batch * (args.warmup + args.steps), args.length, vocab)
    out = tempfile.mkdtemp()
    times: dict = {"plain": [], "keyed": []}
    for r in range(args.rounds):
        for name in (("plain", "keyed") if r % 2 == 0 else ("keyed", "plain")):
            model.load_state_dict(state)
            training = transformers.TrainingArguments(
                output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.warmup + args.steps,
                learning_rate=1e-4, seed=0, report_to="none", disable_tqdm=True, save_strategy="no",
                logging_strategy="no", use_cpu=not torch.cuda.is_available())
            clock = _Clock(args.clock)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = transformers.Trainer(model=model, args=training, train_dataset=data, callbacks=[clock],
                                               data_collator=transformers.DataCollatorForLanguageModeling(tokenizer))
            if name == "keyed":
                keyed_trainer(trainer)
            trainer.train()
            times[name] += clock.times[args.warmup:]
            print(f"  round {r} {name}: median {statistics.median(clock.times[args.warmup:]) * 1e3:.1f} ms/step",
                  flush=True)
    plain, keyed = (statistics.median(times[n]) for n in ("plain", "keyed"))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    print(f"BertForMaskedLM hidden {args.dim} x {args.layers} layers, batch {args.batch} x <= {args.length} tokens, "
          f"{device}, torch {torch.__version__}, transformers {transformers.__version__}, {args.clock} time")
    print(f"  plain Trainer step {plain * 1e3:8.2f} ms   keyed Trainer step {keyed * 1e3:8.2f} ms   "
          f"keyed / plain {keyed / plain:.3f}")
    print(json.dumps({"plain_ms": plain * 1e3, "keyed_ms": keyed * 1e3, "keyed_over_plain": keyed / plain}))


if __name__ == "__main__":
    main()
