"""An HF BERT masked LM trained with dynamic padding gives one process's masks and losses on 1, 2 and 4 ranks.

The setting of issue 33's "Done when": ``BertForMaskedLM`` (hidden and attention dropout 0.1, SDPA),
built with ``keyinit.deferred``, sharded with FSDP2 on real gloo ranks and materialized per shard;
data from ``keyed_samples`` + ``KeyedSampler.batch_sampler`` + ``keyed_collate(DataCollatorForLanguage
Modeling)``, which pads each (micro-)batch to its own longest sample (variable-length samples); every
forward under ``keyinit.nn.keyed(model, seed, step=step, samples=batch, stream="v2")``: no offset, no
rank arithmetic. Layouts: one process (the reference, no process group, no FSDP); 2 ranks; 2 ranks x 2
micro-batches with gradient accumulation; 4 ranks for 2 steps, saved (model and optimizer by DCP, the
sampler's ``state_dict``), resumed on 2 ranks with micro-batches of one sample.

Asserted: every layout's global data order and MLM masks (the real tokens and labels of global sample
``(step, position)``) equal the reference's; every dropout mask, read at the kernel seam
(``keyinit._draw.dispatch.dropout``, the mask of a tensor of ones under the same geometry) and cut to
the real tokens of its sample (hidden ``(b, L, d)``: ``[:len]``; attention ``(b, h, L, L)``:
``[:, :len, :len]``), is bitwise the reference's; each step's loss (the sum over masked tokens divided by
the step's global count, HF Trainer's ``num_items_in_batch``) agrees within 1e-5. A control: under
stream v1 the same model, one process, whole batches against micro-batches padded to their own
longest, gives other masks on real tokens.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Optional

import pytest
import torch
from torch.utils.data import DataLoader

from tests._support.vision import define_torchvision_schemas

define_torchvision_schemas()  # transformers imports torchvision when it is installed (also in the ranks)
transformers = pytest.importorskip("transformers")

import keyinit  # noqa: E402
import keyinit.nn as knn  # noqa: E402
from keyinit._draw import dispatch  # noqa: E402
from keyinit.data import KeyedSampler, keyed_collate, keyed_samples, sample_positions  # noqa: E402
from tests._support.dist import requires_gloo, run_distributed  # noqa: E402
from tests._support.words import SPECIAL, WORDS, Sentences, WordTokenizer  # noqa: E402

N, B, STEPS, SEED, DATA_SEED, INIT_SEED = 32, 8, 4, 7, 11, 3
#: the tokenizer and the samples (tests/_support/words.py)
_Tokenizer = WordTokenizer
_Sentences = functools.partial(Sentences, N)


def _build() -> torch.nn.Module:
    config = transformers.BertConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
                                     hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return keyinit.deferred(transformers.BertForMaskedLM, config)


def _loader(rank: int, world: int, micro: Optional[int], sampler: Optional[KeyedSampler] = None):
    sampler = sampler or KeyedSampler(N, DATA_SEED, global_batch_size=B, rank=rank, world_size=world,
                                      num_steps=STEPS)
    collate = keyed_collate(transformers.DataCollatorForLanguageModeling(_Tokenizer()), DATA_SEED)
    loader = DataLoader(keyed_samples(_Sentences(), DATA_SEED), batch_sampler=sampler.batch_sampler(micro),
                        collate_fn=collate)
    return loader, sampler


class _Masks:
    """Records the keep-mask of every keyed dropout of a forward at the kernel seam (while ``on``)."""

    def __init__(self) -> None:
        self.on, self.seen = False, []
        self._kernel = dispatch.dropout

    def __enter__(self) -> "_Masks":
        def recorded(x: torch.Tensor, geometry: Any) -> torch.Tensor:
            if self.on:
                self.seen.append(self._kernel(torch.ones_like(x), geometry) != 0)
            return self._kernel(x, geometry)

        dispatch.dropout = recorded
        return self

    def __exit__(self, *exc: Any) -> None:
        dispatch.dropout = self._kernel


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, steps: int,
           stream: str, world: int = 1) -> dict:
    """``steps`` optimizer steps from ``loader``; each step's loss and, per global sample, its real tokens,
    labels and dropout masks on real tokens."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    out: dict = {"losses": {}, "data": {}, "masks": {}, "width": {}}
    batches = iter(loader)
    per_step = loader.batch_sampler.sampler.local_batch_size // loader.batch_sampler.micro_batch_size
    model.train()
    with _Masks() as recorder:
        for _ in range(steps):
            micro_batches = [next(batches) for _ in range(per_step)]
            step = sample_positions(micro_batches[0]).step
            count = torch.tensor(float(sum(int((b["labels"] != -100).sum()) for b in micro_batches)))
            if distributed:
                dist.all_reduce(count)  # the step's masked tokens (HF Trainer's num_items_in_batch)
            total = torch.zeros(())
            for batch in micro_batches:
                first = sample_positions(batch).first
                lengths = batch["attention_mask"].sum(1).tolist()
                with knn.keyed(model, SEED, step=step, samples=batch, stream=stream):
                    recorder.on, recorder.seen = True, []
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    recorder.on = False
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                             batch["labels"].reshape(-1), reduction="sum")
                    (loss * world / count).backward()  # (FSDP2 averages the ranks' gradients)
                total += loss.detach()
                for r, n in enumerate(lengths):
                    position = first + r
                    out["data"][(step, position)] = (batch["input_ids"][r, :n].clone(), batch["labels"][r, :n].clone())
                    out["width"][(step, position)] = batch["input_ids"].shape[1]  # the length it was padded to
                    for call, mask in enumerate(recorder.seen):
                        real = mask[r, :n] if mask.dim() == 3 else mask[r, :, :n, :n]
                        out["masks"][(step, position, call)] = real.clone()
            optimizer.step()
            optimizer.zero_grad()
            if distributed:
                dist.all_reduce(total)
            out["losses"][step] = float(total / count)
    return out


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _one_process(stream: str, micro: Optional[int]) -> dict:
    model = _build()
    keyinit.materialize(model, INIT_SEED, device="cpu")
    loader, _ = _loader(0, 1, micro)
    return _train(model, _optimizer(model), loader, STEPS, stream)


def _sharded() -> torch.nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _build()
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    keyinit.materialize(model, INIT_SEED, device="cpu")  # each rank fills its own shards
    return model


def _ranks(micros: list, save_at: Optional[int] = None, checkpoint: Optional[str] = None) -> list:
    """On every rank: a fresh sharded model trained for STEPS steps per micro-batch size in ``micros``;
    with ``save_at``, the first run saves the model, optimizer and sampler after that many steps."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    runs = []
    for micro in micros:
        model = _sharded()
        optimizer = _optimizer(model)
        loader, sampler = _loader(rank, world, micro)
        if save_at is None:
            runs.append(_train(model, optimizer, loader, STEPS, "v2", world))
            continue
        first = _train(model, optimizer, loader, save_at, "v2", world)
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)
        if rank == 0:
            torch.save(sampler.state_dict(), os.path.join(checkpoint, "sampler.pt"))
        rest = _train(model, optimizer, loader, STEPS - save_at, "v2", world)  # the run goes on unbroken
        runs.append({k: {**first[k], **rest[k]} for k in first})
    return runs


def _resume(checkpoint: str, micro: int) -> dict:
    """On every rank: the checkpoint of another world size loaded, the run continued to STEPS."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _sharded()
    optimizer = _optimizer(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sampler = KeyedSampler(N, DATA_SEED, global_batch_size=B, rank=dist.get_rank(), world_size=dist.get_world_size())
    sampler.load_state_dict(torch.load(os.path.join(checkpoint, "sampler.pt")))
    loader, _ = _loader(0, 0, micro, sampler=sampler)
    return _train(model, optimizer, loader, STEPS - sampler.step, "v2", dist.get_world_size())


def _merge(runs: list) -> dict:
    """The ranks' records of one run as one: each rank holds its own samples; losses agree across ranks."""
    merged: dict = {"losses": runs[0]["losses"], "data": {}, "masks": {}, "width": {}}
    for run in runs:
        assert run["losses"] == runs[0]["losses"]  # the all-reduced loss: one value on every rank
        for k in ("data", "masks", "width"):
            assert not merged[k].keys() & run[k].keys()
            merged[k].update(run[k])
    return merged


def _padded(run: dict) -> int:
    """How many samples of ``run`` were padded."""
    return sum(width > len(run["data"][k][0]) for k, width in run["width"].items())


def _padded_otherwise(run: dict, reference: dict) -> int:
    """How many samples of ``run`` were padded to another length than in ``reference``."""
    return sum(width != reference["width"][k] for k, width in run["width"].items())


def _differing_masks(got: dict, want: dict) -> int:
    assert got.keys() == want.keys()
    return sum(not torch.equal(got[k], want[k]) for k in want)


def _assert_matches(got: dict, want: dict, steps=range(STEPS)) -> float:
    """Same data, MLM masks and dropout masks on real tokens as ``want`` for ``steps``; the max loss difference."""
    picked = {k: v for k, v in want["data"].items() if k[0] in steps}
    assert got["data"].keys() == picked.keys()
    for k, (tokens, labels) in picked.items():
        assert torch.equal(got["data"][k][0], tokens) and torch.equal(got["data"][k][1], labels), k
    assert _differing_masks(got["masks"], {k: v for k, v in want["masks"].items() if k[0] in steps}) == 0
    assert got["losses"].keys() == set(steps)
    difference = max(abs(got["losses"][s] - want["losses"][s]) for s in steps)
    assert difference <= 1e-5, (got["losses"], want["losses"])
    return difference


@pytest.fixture(scope="module")
def reference() -> dict:
    run = _one_process("v2", None)
    # the reference is a real test: padded samples, 7 keyed dropouts a forward, all masks different
    assert _padded(run) > 0 and len(run["masks"]) == STEPS * B * 7
    assert len({tuple(m.flatten().tolist()) for m in run["masks"].values()}) == len(run["masks"])
    assert all(torch.isfinite(torch.tensor(list(run["losses"].values()))))
    return run


def test_v1_masks_change_with_the_padded_length():
    """The control: under stream v1 a sample's masks depend on how far its batch is padded."""
    whole, micro = _one_process("v1", None), _one_process("v1", 2)
    assert _padded_otherwise(micro, whole) > 0 and whole["data"].keys() == micro["data"].keys()
    differing = _differing_masks(micro["masks"], whole["masks"])
    print(f"stream v1: {differing} of {len(whole['masks'])} dropout masks on real tokens differ")
    assert differing > len(whole["masks"]) // 4


@pytest.mark.slow
@requires_gloo
def test_two_ranks_with_and_without_micro_batches(reference):
    plain, micro = (_merge(run) for run in zip(*run_distributed(_ranks, 2, args=([None, 2],), timeout=240)))
    assert _padded_otherwise(plain, reference) > 0 and _padded_otherwise(micro, reference) > 0
    print("max loss difference: 2 ranks", _assert_matches(plain, reference),
          "2 ranks x 2 micro-batches", _assert_matches(micro, reference))


@pytest.mark.slow
@requires_gloo
def test_four_ranks_then_resumed_on_two(reference, tmp_path):
    checkpoint = str(tmp_path / "checkpoint")
    (four,) = (_merge(run) for run in zip(*run_distributed(_ranks, 4, args=([None], STEPS // 2, checkpoint),
                                                               timeout=240)))
    resumed = _merge(run_distributed(_resume, 2, args=(checkpoint, 1), timeout=240))
    assert _padded(resumed) == 0 and _padded_otherwise(four, reference) > 0  # batches of one: never padded
    print("max loss difference: 4 ranks", _assert_matches(four, reference),
          "4 ranks resumed on 2 x 4 micro-batches of 1",
          _assert_matches(resumed, reference, steps=range(STEPS // 2, STEPS)))
