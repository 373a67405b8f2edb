"""A Lightning ``Trainer`` with ``KeyedTraining``: one process's data, masks and losses on 2 gloo ranks and across a resume.

The model: an embedding, dropout 0.1 and ``nn.MultiheadAttention`` (attention dropout 0.1, a key padding
mask), built on meta in ``configure_model`` with ``keyinit.deferred`` and materialized by the callback.
The data: 24 token sequences of 3 to 11 tokens, padded per batch to its longest (dynamic padding), 30%
of the real tokens masked in the collate function (an MLM collator in miniature, ``torch.rand``). The
loss of a micro-batch is its masked tokens' summed loss over its rows, so the optimizer's gradient is
the global batch's mean whatever the cut (Lightning divides by ``accumulate_grad_batches``, DDP averages).

Layouts of the global batch of 8: one process, ``batch_size=8`` (the reference); 2 DDP ranks,
``batch_size=2``, ``accumulate_grad_batches=2``, which saves a checkpoint after step 2 (mid-epoch: an
epoch is 3 steps); that checkpoint resumed in one process with ``batch_size=8`` and no accumulation (the
loop's batch counters converted). Asserted: each global sample position's real tokens and labels, and
every dropout mask on its real tokens (read at the kernel seam, as tests/data/test_mlm_dynamic_padding.py
does) bitwise the reference's; each sample's loss within 1e-5. The control: a plain Trainer (no
callback, ``seed_everything``) gives other data and masks for ``batch_size=8`` and ``2 x 4``.
"""

from __future__ import annotations

import glob
import os
import warnings
from typing import Any, Optional

import pytest
import torch
from torch import nn

from tests._support.vision import define_torchvision_schemas

define_torchvision_schemas()  # lightning imports torchmetrics, which imports torchvision (also in the ranks)
pl = pytest.importorskip("lightning.pytorch")

import keyinit  # noqa: E402
from keyinit._draw import dispatch  # noqa: E402
from keyinit.data import SamplePositions  # noqa: E402
from keyinit.integrations.lightning import KeyedTraining  # noqa: E402
from tests._support.dist import requires_gloo, run_distributed  # noqa: E402

N, B, STEPS, VOCAB, SEED = 24, 8, 4, 32, 5
DATA = [(torch.arange(3 + (i * 5) % 9) * 7 + i) % (VOCAB - 3) + 2 for i in range(N)]   # 0 pads, 1 masks


class TinyLM(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.drop = nn.Dropout(0.1)
        self.attn = nn.MultiheadAttention(dim, 2, dropout=0.1, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.emb(tokens))
        x = x + self.attn(x, x, x, key_padding_mask=tokens == 0, need_weights=False)[0]
        return self.head(x)


def collate(samples: list) -> dict:
    """Pad to the batch's longest sample; mask 30% of the real tokens (their labels: the tokens)."""
    ids = nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=0)
    masked = (torch.rand(ids.shape) < 0.3) & (ids != 0)
    return {"input_ids": ids.masked_fill(masked, 1), "labels": ids.masked_fill(~masked, -100),
            "lengths": (ids != 0).sum(1)}


class _Masks:
    """Records the keep-mask of every keyed dropout at the kernel seam."""

    def __init__(self) -> None:
        self.seen: list = []
        self._kernel = dispatch.dropout

    def __enter__(self) -> "_Masks":
        def recorded(x: torch.Tensor, geometry: Any) -> torch.Tensor:
            self.seen.append(self._kernel(torch.ones_like(x), geometry) != 0)
            return self._kernel(x, geometry)

        dispatch.dropout = recorded
        return self

    def __exit__(self, *exc: Any) -> None:
        dispatch.dropout = self._kernel


class Module(pl.LightningModule):
    def __init__(self, batch_size: int, keyed: bool = True, workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.keyed, self.workers = batch_size, keyed, workers
        self.record: dict = {"data": {}, "masks": {}, "loss": {}}

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = keyinit.deferred(TinyLM) if self.keyed else TinyLM()

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(DATA, batch_size=self.batch_size, collate_fn=collate, shuffle=True,
                                           num_workers=self.workers)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        with _Masks() as masks:
            logits = self.model(batch["input_ids"])
        per_token = nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
        per_sample = per_token.sum(1)
        callback = next((c for c in self.trainer.callbacks if isinstance(c, KeyedTraining)), None)
        if callback is not None:  # (the control has no positions: its rows are numbered by batch_idx)
            step, first = callback.positions.step, callback.positions.first
        else:
            step, first = self.trainer.global_step, batch_idx % self.trainer.accumulate_grad_batches * self.batch_size
        _note(self.record, batch, SamplePositions(step, first, len(per_sample), B), masks.seen, per_sample)
        return per_sample.sum() / len(per_sample)


def _note(record: dict, batch: dict, positions: SamplePositions, masks: list, per_sample: torch.Tensor) -> None:
    """Each row's real tokens, labels, dropout masks on real tokens and loss, under its global position."""
    for r, n in enumerate(batch["lengths"].tolist()):
        key = (positions.step, positions.first + r)
        record["data"][key] = (batch["input_ids"][r, :n].clone(), batch["labels"][r, :n].clone())
        record["loss"][key] = float(per_sample[r].detach())
        for call, mask in enumerate(masks):
            record["masks"][key + (call,)] = (mask[r, :n] if mask.dim() == 3 else mask[r, :, :n, :n]).clone()


def _trainer(callbacks: list, accumulate: int, steps: int, devices: int = 1, **kwargs: Any) -> "pl.Trainer":
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    return pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                      max_steps=steps, accumulate_grad_batches=accumulate, callbacks=callbacks, logger=False,
                      enable_checkpointing=bool(kwargs.pop("checkpointing", False)), enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _fit(batch_size: int, accumulate: int, steps: int = STEPS, keyed: bool = True, devices: int = 1, workers: int = 0,
         save_every: Optional[int] = None, ckpt_dir: Optional[str] = None, resume: Optional[str] = None) -> dict:
    callbacks: list = [KeyedTraining(SEED)] if keyed else []
    if save_every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=save_every, save_top_k=-1))
    if not keyed:
        pl.seed_everything(SEED, verbose=False)
    module = Module(batch_size, keyed, workers)
    trainer = _trainer(callbacks, accumulate, steps, devices, checkpointing=bool(save_every))
    trainer.fit(module, ckpt_path=resume)
    return module.record


class Sharded(Module):
    """The model sharded by FSDP2 in ``configure_model`` (Lightning's ``ModelParallelStrategy``), still on meta."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if not hasattr(self, "model"):
            self.model = keyinit.deferred(TinyLM)
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.model.attn, mesh=mesh)
            fully_shard(self.model, mesh=mesh)


def _model_parallel(batch_size: int) -> dict:
    module, world = Sharded(batch_size), torch.distributed.get_world_size()
    strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS,
                         callbacks=[KeyedTraining(SEED)], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return module.record


class _Holder(nn.Module):
    """The LightningModule's tree (``model.emb``, ...): the same FQNs, so the same init and dropout keys."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)


def _shard(model: nn.Module, mesh: Any) -> nn.Module:
    """A ``parallelize_fn`` for Fabric's ``ModelParallelStrategy``: FSDP2 over the data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.model.attn, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _fabric(batch_size: int, accumulate: int, sharded: bool = False) -> dict:
    """A Fabric loop: keyinit's init before ``fabric.setup`` (or in ``keyed_parallelize`` when ``sharded``),
    ``fabric_dataloader``, ``loader.keyed(model)``."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from keyinit.integrations.lightning import fabric_dataloader, keyed_parallelize

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if sharded:
        strategy = ModelParallelStrategy(keyed_parallelize(_shard, SEED), data_parallel_size=world,
                                         tensor_parallel_size=1)
        fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        model = fabric.setup(keyinit.deferred(_Holder))  # sharded, then materialized by keyinit
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto")
        fabric.launch()
        model = keyinit.deferred(_Holder)
        keyinit.materialize(model, SEED, device=fabric.device)
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = fabric_dataloader(fabric, Module(batch_size).train_dataloader(), SEED, accumulate=accumulate)
    record = Module(batch_size).record
    batches = (batch for _ in iter(int, 1) for batch in loader)  # epoch after epoch (each goes on from the last)
    for _ in range(STEPS):
        for micro in range(accumulate):
            batch = next(batches)
            with fabric.no_backward_sync(model, enabled=micro + 1 < accumulate), loader.keyed(model, SEED):
                with _Masks() as masks:
                    logits = model(batch["input_ids"])
                loss = nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").sum(1)
                fabric.backward(loss.sum() / len(loss) / accumulate)
            _note(record, batch, loader.positions, masks.seen, loss)
        optimizer.step()
        optimizer.zero_grad()
    return record


def _two_ranks(ckpt_dir: str, one_process_checkpoint: str) -> dict:
    """On 2 ranks: DDP (batch 2 x 2 micro-batches, a checkpoint after step 2), ModelParallelStrategy (batch 4),
    a Fabric loop (batch 2 x 2 micro-batches) under DDP and under Fabric's ModelParallelStrategy; the one-process
    run's checkpoint after step 2 resumed under DDP with batch 2 x 2 micro-batches."""
    return {"ddp": _fit(2, 2, devices=2, save_every=2, ckpt_dir=ckpt_dir), "fsdp": _model_parallel(B // 2),
            "fabric": _fabric(2, 2), "fabric_fsdp": _fabric(2, 2, sharded=True),
            "resumed": _fit(2, 2, devices=2, resume=one_process_checkpoint)}


def _merge(runs: list) -> dict:
    merged: dict = {k: {} for k in runs[0]}
    for run in runs:
        for k in merged:
            assert not merged[k].keys() & run[k].keys()
            merged[k].update(run[k])
    return merged


def _assert_matches(got: dict, want: dict, steps: range = range(STEPS)) -> float:
    """``got``'s data, masks and losses are ``want``'s for ``steps``; the largest loss difference."""
    for k in ("data", "masks"):
        expected = {key: v for key, v in want[k].items() if key[0] in steps}
        assert got[k].keys() == expected.keys(), k
        for key, value in expected.items():
            assert all(map(torch.equal, got[k][key], value)) if k == "data" else torch.equal(got[k][key], value), key
    difference = max(abs(got["loss"][key] - want["loss"][key]) for key in got["loss"])
    assert difference <= 1e-5, difference
    return difference


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process, whole global batches; its checkpoints after steps 2 and 4 in ``run["checkpoints"]``."""
    ckpt_dir = str(tmp_path_factory.mktemp("reference"))
    run = _fit(B, 1, save_every=2, ckpt_dir=ckpt_dir)
    padded = sum(run["data"][key][0].numel() < max(run["data"][k][0].numel() for k in run["data"] if k[0] == key[0])
                 for key in run["data"])
    assert padded > 0 and len(run["data"]) == STEPS * B and len(run["masks"]) == STEPS * B * 2
    assert len({tuple(m.flatten().tolist()) for m in run["masks"].values()}) == len(run["masks"])
    run["checkpoint"], = glob.glob(os.path.join(ckpt_dir, "*step=2.ckpt"))
    return run


def test_plain_trainer_differs_with_the_layout():
    """The control: without the callback (``seed_everything``, the same init) the same global batch cut
    2 x 4 gets other data and MLM masks, and other losses from its first step (dropout drawn unkeyed, at
    the seam these tests cannot read)."""
    whole, cut = _fit(B, 1, keyed=False), _fit(2, 4, keyed=False)
    assert whole["data"].keys() == cut["data"].keys() and not whole["masks"]
    same_data = sum(all(map(torch.equal, cut["data"][k], whole["data"][k])) for k in whole["data"])
    first = [k for k in whole["loss"] if k[0] == 0]
    same_loss = sum(abs(cut["loss"][k] - whole["loss"][k]) <= 1e-5 for k in first)
    assert same_data < len(whole["data"]) // 4 and same_loss < len(first) // 4, (same_data, same_loss)


def test_accumulation_in_one_process(reference):
    """``batch_size=2`` x ``accumulate_grad_batches=4``, collated in 2 DataLoader workers (which read ahead, and
    whose collated dicts reach Lightning without the positions): the reference's data, masks and losses."""
    module = Module(2, workers=2)
    before = torch.get_rng_state()
    _trainer([KeyedTraining(SEED)], 4, STEPS).fit(module)
    assert torch.equal(torch.get_rng_state(), before)  # the run does not advance the global RNG
    _assert_matches(module.record, reference)
    # nothing of keyinit's left on the module: no hook, no wrapper of configure_model
    assert "configure_model" not in vars(module)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def test_loaders_keyinit_cannot_order_are_refused():
    from keyinit.integrations.lightning import keyed_dataloader

    DataLoader = torch.utils.data.DataLoader
    batches = torch.utils.data.BatchSampler(range(N), 4, drop_last=False)
    with pytest.raises(ValueError, match="the DataLoader has a batch_sampler of its own and no batch_size"):
        keyed_dataloader(DataLoader(DATA, batch_sampler=batches), SEED)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(DATA)

    with pytest.raises(TypeError, match="an IterableDataset has no sample indices to order"):
        keyed_dataloader(DataLoader(Stream(), batch_size=2), SEED)
    with pytest.raises(TypeError, match="expected a torch.utils.data.DataLoader, got list"):
        keyed_dataloader(DATA, SEED)
    loader = keyed_dataloader(DataLoader(DATA, batch_size=2, collate_fn=collate), SEED, accumulate=2)
    other = keyed_dataloader(DataLoader(DATA, batch_size=2, collate_fn=collate), SEED + 1, accumulate=2)
    with pytest.raises(ValueError, match="KeyedSampler state_dict does not match this sampler"):
        other.load_state_dict(loader.state_dict())  # another data seed: another order


@requires_gloo
def test_fabric_in_one_process(reference):
    """A Fabric loop, ``batch_size=4`` x 2 micro-batches: the reference's data, masks and losses (its model
    has the LightningModule's FQNs)."""
    _assert_matches(_fabric(4, 2), reference)


@pytest.mark.slow
@requires_gloo
def test_two_ranks_and_resumes_across_world_sizes(reference, tmp_path):
    """2 ranks under DDP, ModelParallelStrategy and Fabric; a one-process checkpoint resumed on 2 ranks and a
    2-rank checkpoint resumed on one process (``accumulate_grad_batches`` 1 -> 2 and 2 -> 1)."""
    ckpt_dir = str(tmp_path / "checkpoints")
    runs = run_distributed(_two_ranks, 2, args=(ckpt_dir, reference["checkpoint"]), timeout=240)
    for name in ("ddp", "fsdp", "fabric", "fabric_fsdp"):
        print(f"max loss difference, 2 ranks, {name}:", _assert_matches(_merge([r[name] for r in runs]), reference))
    print("max loss difference, one process's checkpoint resumed on 2 ranks:",
          _assert_matches(_merge([r["resumed"] for r in runs]), reference, range(2, STEPS)))
    checkpoint, = glob.glob(os.path.join(ckpt_dir, "*step=2.ckpt"))
    saved = torch.load(checkpoint, weights_only=False)
    loader_state, = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state["sampler"]["step"] == 2 and loader_state["micro_batches"] == 2
    assert all(k.startswith("model.") for k in saved["state_dict"])  # nothing of keyinit's in the weights
    resumed = _fit(B, 1, resume=checkpoint)
    print("max loss difference, resumed on one process:", _assert_matches(resumed, reference, range(2, STEPS)))


# ---------------------------------------------------------------------- an HF BERT masked LM
class _Words(object):
    """Sample ``i``: ``[CLS]``, 3 to 11 words, ``[SEP]`` (ids: 0 pad, 1 unk, 2 cls, 3 sep, 4 mask, 5.. words)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": [2] + [5 + (i * 7 + 3 * j) % 27 for j in range(3 + (i * 5) % 9)] + [3]}


def _tokenizer() -> Any:
    import transformers

    class Tokenizer(transformers.PreTrainedTokenizer):
        """A word-level tokenizer with no files: what ``DataCollatorForLanguageModeling`` pads and masks with."""

        def __init__(self, **kwargs: Any) -> None:
            self._names = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(27)]
            super().__init__(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                             mask_token="[MASK]", **kwargs)

        @property
        def vocab_size(self) -> int:
            return len(self._names)

        def get_vocab(self) -> dict:
            return {t: i for i, t in enumerate(self._names)}

        def _tokenize(self, text: str) -> list:
            return text.split()

        def _convert_token_to_id(self, token: str) -> int:
            return self._names.index(token) if token in self._names else 1

        def _convert_id_to_token(self, index: int) -> str:
            return self._names[index]

    return Tokenizer()


class BertModule(Module):
    """``BertForMaskedLM`` (hidden and attention dropout 0.1), ``DataCollatorForLanguageModeling``'s dynamic
    padding and masking; the collated ``BatchEncoding`` reaches ``training_step`` still carrying its positions."""

    def configure_model(self) -> None:
        import transformers

        if not hasattr(self, "model"):
            config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=32, max_position_embeddings=16,
                                             hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
            self.model = keyinit.deferred(transformers.BertForMaskedLM, config)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        import transformers

        return torch.utils.data.DataLoader(_Words(), batch_size=self.batch_size, shuffle=True, num_workers=self.workers,
                                           collate_fn=transformers.DataCollatorForLanguageModeling(_tokenizer()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        callback, = (c for c in self.trainer.callbacks if isinstance(c, KeyedTraining))
        assert keyinit.data.sample_positions(batch) == callback.positions  # the batch Lightning moved still says
        with _Masks() as masks:
            logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        per_token = nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
        per_sample = per_token.sum(1)
        batch = {**batch, "lengths": batch["attention_mask"].sum(1)}
        _note(self.record, batch, callback.positions, masks.seen, per_sample)
        return per_sample.sum() / len(per_sample)


def _fit_bert(batch_size: int, accumulate: int, workers: int = 0) -> dict:
    module = BertModule(batch_size, workers=workers)
    _trainer([KeyedTraining(SEED)], accumulate, STEPS).fit(module)
    return module.record


def test_hf_bert_mlm_accumulation():
    """Whole batches of 8 against 4 micro-batches of 2 collated in 2 workers: the same tokens, MLM masks, dropout
    masks on real tokens (7 a forward) and losses."""
    pytest.importorskip("transformers")
    whole, cut = _fit_bert(B, 1), _fit_bert(2, 4, workers=2)
    assert len(whole["masks"]) == STEPS * B * 7
    print("max loss difference, BERT 2 x 4:", _assert_matches(cut, whole))
