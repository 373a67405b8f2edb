"""A Lightning ``Trainer`` step with and without ``KeyedTraining``, measured in one run.

    python benchmarks/bench_lightning_step.py                 # CPU: dim 256, 2 layers, batches of 16 x 32..64 tokens
    python benchmarks/bench_lightning_step.py --dry-run       # tiny, a few steps (numbers mean nothing)

The model: an embedding, ``nn.TransformerEncoder`` (dim 256, 4 heads, feed-forward 1024, dropout 0.1,
attention dropout 0.1) and a head over a vocabulary of 1000. The data: 512 token sequences of 32 to 64
tokens, padded per batch to its longest, 15% of the real tokens masked in the collate function. Two
variants of the same ``Trainer`` (AdamW, ``batch_size=16``, ``accumulate_grad_batches=2``):

1. ``plain``: the user's DataLoader (``shuffle=True``), torch's dropout (the global RNG);
2. ``keyed``: ``callbacks=[KeyedTraining(seed)]``: the keyed loader, ``keyed_collate`` and every forward
   and backward inside ``keyinit.nn.keyed``.

A step is the time between two consecutive ``on_train_batch_end`` calls (data, forward, backward and,
every second micro-batch, the optimizer). Fits alternate (plain, keyed, plain, ...), so both see the
same machine state; the first steps of each fit are not counted. Reported: each variant's median
micro-batch time and ``keyed / plain``. This is not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests._support.vision import define_torchvision_schemas  # noqa: E402

define_torchvision_schemas()  # lightning imports torchmetrics, which imports torchvision
import lightning.pytorch as pl  # noqa: E402

import keyinit  # noqa: E402
from keyinit.integrations.lightning import KeyedTraining  # noqa: E402

VOCAB = 1000


class Encoder(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(tokens), src_key_padding_mask=tokens == 0))


def collate(samples: list) -> dict:
    ids = nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=0)
    masked = (torch.rand(ids.shape) < 0.15) & (ids != 0)
    return {"input_ids": ids.masked_fill(masked, 1), "labels": ids.masked_fill(~masked, -100)}


class Module(pl.LightningModule):
    def __init__(self, data: list, dim: int, layers: int, keyed: bool) -> None:
        super().__init__()
        self.data, self.dim, self.layers, self.keyed = data, dim, layers, keyed

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = keyinit.deferred(Encoder, self.dim, self.layers) if self.keyed else Encoder(self.dim, self.layers)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.data, batch_size=16, collate_fn=collate, shuffle=True)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        return nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Clock(pl.Callback):
    def __init__(self) -> None:
        self.times: list = []
        self._last = None

    def on_train_batch_end(self, *args: object) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def fit(data: list, dim: int, layers: int, keyed: bool, steps: int, skip: int) -> list:
    clock = Clock()
    callbacks = [KeyedTraining(0), clock] if keyed else [clock]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=2,
                         callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Module(data, dim, layers, keyed))
    return clock.times[skip:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="a tiny model, a few steps")
    parser.add_argument("--rounds", type=int, default=2, help="fits of each variant, alternating")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps a fit")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dim, layers, steps, rounds = (32, 1, 3, 1) if args.dry_run else (256, 2, args.steps, args.rounds)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(2, VOCAB, (int(torch.randint(32, 65, (), generator=g)),), generator=g) for _ in range(512)]
    times: dict = {"plain": [], "keyed": []}
    torch.manual_seed(0)
    for _ in range(rounds):
        for name in ("plain", "keyed"):
            times[name] += fit(data, dim, layers, name == "keyed", steps, skip=2)
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {"threads": torch.get_num_threads(), "dim": dim, "layers": layers, "micro_batches_timed":
              {k: len(v) for k, v in times.items()}, "median_s": medians, "keyed_over_plain":
              medians["keyed"] / medians["plain"]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
