"""An HF ``Trainer`` keyed with one call gives one process's data, masks and losses on 2 ranks and across a resume.

``keyinit.integrations.transformers.keyed_trainer(trainer)`` on an unchanged ``Trainer`` fine-tuning a tiny
``BertForMaskedLM`` (hidden and attention dropout 0.1, built with ``keyinit.deferred``) with
``DataCollatorForLanguageModeling`` (dynamic padding: each micro-batch padded to its own longest sample).
Layouts, each with the global batch of ``B`` samples a step: one process, ``per_device_train_batch_size=B``
(the reference); 2 gloo ranks (DDP through accelerate) with ``per_device_train_batch_size=B/4`` and
``gradient_accumulation_steps=2``, saving a Trainer checkpoint at step 2; that checkpoint resumed on one
process with micro-batches of ``B/2`` and a DataLoader worker. The same for a tiny ``GPT2LMHeadModel``
(its own loss, a plain-dict collate function) on one process and on 2 ranks.

Asserted, per global sample ``(step, position)``: the real tokens and MLM labels, and every dropout mask
cut to the sample's real tokens (read at the kernel seam, ``keyinit._draw.dispatch.dropout``), bitwise the
reference's; the Trainer's logged loss of each step within 1e-5 and the final parameters within 1e-4. The
control: the plain ``Trainer`` on the same two layouts gives other losses. And: evaluation runs untouched,
the saved model holds the model's own keys and config, nothing of keyinit.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Optional

import pytest
import torch

from tests._support.vision import define_torchvision_schemas

define_torchvision_schemas()  # transformers imports torchvision when it is installed (also in the ranks)
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import keyinit  # noqa: E402
from keyinit._draw import dispatch  # noqa: E402
from keyinit.data import sample_positions  # noqa: E402
from keyinit.integrations.transformers import keyed_trainer, saved_sampler_state  # noqa: E402
from tests._support.dist import requires_gloo, run_distributed  # noqa: E402
from tests._support.words import SPECIAL, WORDS, Sentences, WordTokenizer  # noqa: E402

N, B, STEPS, SEED, INIT_SEED = 24, 8, 4, 5, 3
#: accelerate's CPU setup reads these (the process group is already up: run_distributed made it)
_ACCELERATE_ENV = {"MASTER_ADDR": "localhost", "LOCAL_WORLD_SIZE": "2"}
#: the tokenizer and the samples (tests/_support/words.py)
_Tokenizer = WordTokenizer
_Sentences = functools.partial(Sentences, N)


def _model(kind: str = "mlm") -> torch.nn.Module:
    """A tiny BERT masked LM or GPT-2 causal LM, every dropout 0.1, built keyed (the same weights on every rank)."""
    vocab = len(SPECIAL) + len(WORDS)
    if kind == "mlm":
        config = transformers.BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.1,
                                         attention_probs_dropout_prob=0.1)
        model = keyinit.deferred(transformers.BertForMaskedLM, config)
    else:
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                         resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=2,
                                         eos_token_id=3)
        model = keyinit.deferred(transformers.GPT2LMHeadModel, config)
    keyinit.materialize(model, INIT_SEED, device="cpu")
    return model


def _pad_for_causal_lm(features: list) -> dict:
    """A plain-dict collate function: pad on the right to the batch's longest, labels -100 on the padding."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features])
    mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _mlm_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """The masked tokens' summed loss over the whole step's count (the Trainer's ``num_items_in_batch``, all ranks
    and micro-batches): ``BertForMaskedLM``'s own loss is a mean per micro-batch, which depends on the split."""
    logits = outputs["logits"]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                             reduction="sum")
    return loss / num_items_in_batch


class _RecordingMixin:
    """A user's Trainer override that records, per global sample, its data and its dropout masks on real tokens
    (in ``self.records``; also mixed into TRL's ``SFTTrainer`` by tests/integrations/test_trainer_trl.py)."""

    def training_step(self, model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        positions = sample_positions(inputs)
        seen: list = []
        forward = [False]  # the backward draws the masks again: record the forward's
        kernel = dispatch.dropout

        def recorded(x: torch.Tensor, geometry: Any) -> torch.Tensor:
            if forward[0]:
                seen.append(kernel(torch.ones_like(x), geometry) != 0)
            return kernel(x, geometry)

        hooks = (self.model.register_forward_pre_hook(lambda *_: forward.__setitem__(0, True)),
                 self.model.register_forward_hook(lambda *_: forward.__setitem__(0, False)))
        dispatch.dropout = recorded
        try:
            loss = super().training_step(model, inputs, *args, **kwargs)
        finally:
            dispatch.dropout = kernel
            for hook in hooks:
                hook.remove()
        if positions is not None:
            lengths = inputs["attention_mask"].sum(1).tolist()
            for r, n in enumerate(lengths):
                key = (positions.step, positions.first + r)
                self.records["data"][key] = (inputs["input_ids"][r, :n].clone(), inputs["labels"][r, :n].clone())
                for call, mask in enumerate(seen):
                    self.records["masks"][key + (call,)] = mask[r, :n] if mask.dim() == 3 else mask[r, :, :n, :n]
        return loss


class _Recording(_RecordingMixin, transformers.Trainer):
    pass


def _train(output_dir: str, micro: int, accumulate: int, keyed: bool = True, save_steps: Optional[int] = None,
           resume: Optional[str] = None, workers: int = 0, kind: str = "mlm", dataset: Any = None,
           **more: Any) -> dict:
    """A Trainer run of STEPS steps (to its end, also when resumed); its records, losses and final parameters."""
    args = transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulate,
        max_steps=STEPS, learning_rate=1e-2, logging_steps=1, seed=SEED, use_cpu=True, report_to="none",
        disable_tqdm=True, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        dataloader_num_workers=workers, **more)
    dataset = _Sentences() if dataset is None else dataset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "mlm":
            trainer = _Recording(model=_model(kind), args=args, train_dataset=dataset,
                                 data_collator=transformers.DataCollatorForLanguageModeling(_Tokenizer()),
                                 compute_loss_func=_mlm_loss)
        else:  # GPT-2's own loss divides by the Trainer's num_items_in_batch
            trainer = _Recording(model=_model(kind), args=args, train_dataset=dataset,
                                 data_collator=_pad_for_causal_lm)
    trainer.records = {"data": {}, "masks": {}}
    if keyed:
        keyed_trainer(trainer)
    trainer.train(resume_from_checkpoint=resume)
    first = 0 if resume is None else int(resume.rpartition("-")[2])  # (the log history holds the checkpoint's)
    losses = {e["step"] - 1: e["loss"] for e in trainer.state.log_history if "loss" in e and e["step"] > first}
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {**trainer.records, "losses": losses, "params": params}


def _two_ranks(output_dir: str) -> list:
    """On each of 2 ranks: the keyed run (saving at step 2), the plain control, the keyed causal LM."""
    return [_train(output_dir, B // 4, 2, save_steps=2), _train(output_dir + "-plain", B // 4, 2, keyed=False),
            _train(output_dir + "-clm", B // 2, 1, kind="clm")]


def _merge(runs: list) -> dict:
    merged: dict = {"losses": runs[0]["losses"], "params": runs[0]["params"], "data": {}, "masks": {}}
    for run in runs:
        assert run["losses"] == runs[0]["losses"]  # the logged loss is gathered: one value on every rank
        for k in ("data", "masks"):
            assert not merged[k].keys() & run[k].keys()
            merged[k].update(run[k])
    return merged


def _assert_matches(got: dict, want: dict, steps: range, loss_tolerance: float = 1e-5) -> float:
    """Same data, MLM masks and dropout masks on real tokens as ``want`` in ``steps``; the max loss difference."""
    data = {k: v for k, v in want["data"].items() if k[0] in steps}
    assert got["data"].keys() == data.keys()
    for k, (tokens, labels) in data.items():
        assert torch.equal(got["data"][k][0], tokens) and torch.equal(got["data"][k][1], labels), k
    masks = {k: v for k, v in want["masks"].items() if k[0] in steps}
    assert got["masks"].keys() == masks.keys()
    assert sum(not torch.equal(got["masks"][k], m) for k, m in masks.items()) == 0
    assert got["losses"].keys() == set(steps)
    difference = max(abs(got["losses"][s] - want["losses"][s]) for s in steps)
    assert difference <= loss_tolerance, (got["losses"], want["losses"])
    return difference


def _params_differ(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _checked(run: dict) -> dict:
    # a real reference: every global sample seen, padded batches, 7 keyed dropouts a forward, all masks different
    assert len(run["data"]) == STEPS * B and len(run["masks"]) == STEPS * B * 7
    assert len({tuple(m.flatten().tolist()) for m in run["masks"].values()}) == len(run["masks"])
    assert sorted(run["losses"]) == list(range(STEPS))
    return run


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return _checked(_train(str(tmp_path_factory.mktemp("one")), B, 1))


@pytest.fixture(scope="module")
def causal_reference(tmp_path_factory) -> dict:
    return _checked(_train(str(tmp_path_factory.mktemp("one-clm")), B, 1, kind="clm"))


@pytest.mark.slow
@requires_gloo
def test_two_ranks_with_accumulation_then_resumed_on_one(reference, causal_reference, tmp_path):
    output = str(tmp_path / "two")
    ranks = run_distributed(_two_ranks, 2, args=(output,), timeout=240, env=_ACCELERATE_ENV)
    keyed, plain, causal = (_merge(list(run)) for run in zip(*ranks))
    print("max loss difference, 2 ranks x 2 micro-batches:", _assert_matches(keyed, reference, range(STEPS)))
    assert _params_differ(keyed["params"], reference["params"]) < 1e-4
    print("max loss difference, causal LM on 2 ranks:", _assert_matches(causal, causal_reference, range(STEPS)))
    assert _params_differ(causal["params"], causal_reference["params"]) < 1e-4

    checkpoint = os.path.join(output, "checkpoint-2")
    state = saved_sampler_state(checkpoint)  # keyinit's data position, in the Trainer's trainer_state.json
    assert state["step"] == 2 and state["fingerprint"]["global_batch_size"] == B
    resumed = _train(str(tmp_path / "resumed"), B // 2, 2, resume=checkpoint, workers=1)
    print("max loss difference, resumed on 1 process:", _assert_matches(resumed, reference, range(2, STEPS)))
    assert _params_differ(resumed["params"], reference["params"]) < 1e-4

    # the control: the plain Trainer, same arguments and layouts, trains on other data with other masks
    one = _train(str(tmp_path / "plain-one"), B, 1, keyed=False)
    assert max(abs(one["losses"][s] - plain["losses"][s]) for s in range(STEPS)) > 1e-3


def test_evaluation_and_the_saved_model_are_the_trainers_own(reference, tmp_path):
    """Evaluation (eval mode, no dropout) gives the plain Trainer's numbers on the same weights, and
    ``save_model`` writes the model's own state dict and config: nothing of keyinit."""
    losses = []
    for keyed in (True, False):
        model = _model()
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(keyed)), per_device_eval_batch_size=5,
                                              use_cpu=True, report_to="none", disable_tqdm=True)
        collator = transformers.DataCollatorForLanguageModeling(_Tokenizer(), mlm_probability=0.5, seed=1)
        trainer = transformers.Trainer(model=model, args=args, eval_dataset=_Sentences(), data_collator=collator)
        if keyed:
            keyed_trainer(trainer)
        losses.append(trainer.evaluate()["eval_loss"])
        trainer.save_model(str(tmp_path / f"saved-{keyed}"))
    assert losses[0] == losses[1]
    saved = str(tmp_path / "saved-True")
    from safetensors.torch import load_file

    assert set(load_file(os.path.join(saved, "model.safetensors"))) <= set(_model().state_dict())
    with open(os.path.join(saved, "config.json")) as f:
        assert "keyinit" not in f.read()


def test_bad_setups_are_refused(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                          train_sampling_strategy="group_by_length")
    collator = transformers.DataCollatorForLanguageModeling(_Tokenizer())
    trainer = keyed_trainer(transformers.Trainer(model=_model(), args=args, train_dataset=_Sentences(),
                                                 data_collator=collator))
    with pytest.raises(ValueError, match="train_sampling_strategy='group_by_length': keyinit's KeyedSampler"):
        trainer.get_train_dataloader()
    with pytest.raises(ValueError, match="keyed_trainer: this trainer is keyed already"):
        keyed_trainer(trainer)
    with pytest.raises(TypeError, match="keyed_trainer: expected a transformers.Trainer, got Module"):
        keyed_trainer(torch.nn.Module())

    class OwnLoader(transformers.Trainer):
        def get_train_dataloader(self) -> Any:
            return super().get_train_dataloader()

    own = OwnLoader(model=_model(), args=args, train_dataset=_Sentences())
    with pytest.raises(ValueError, match="keyed_trainer: OwnLoader overrides get_train_dataloader; keyinit builds"):
        keyed_trainer(own)


def test_a_resume_with_another_global_batch_or_without_the_skip_is_refused(tmp_path):
    """The checkpoint's data position is checked: another global batch means other samples at every step."""
    _train(str(tmp_path / "run"), B, 1, save_steps=1)
    checkpoint = str(tmp_path / "run" / "checkpoint-1")
    assert saved_sampler_state(checkpoint)["step"] == 1
    with pytest.raises(ValueError, match=f"global_batch_size: saved {B}, this sampler {B // 2}"):
        _train(str(tmp_path / "other"), B // 2, 1, resume=checkpoint)
    with pytest.raises(ValueError, match="inside a pass over the data, with ignore_data_skip=True"):
        _train(str(tmp_path / "other"), B, 1, resume=checkpoint, ignore_data_skip=True)


def test_a_datasets_dataset_gets_the_same_data(reference, tmp_path):
    """An HF ``datasets.Dataset`` train set (its unused columns removed by the Trainer) gives the torch Dataset's."""
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_list([{**_Sentences()[i], "text": f"sample {i}"} for i in range(N)])
    run = _train(str(tmp_path / "table"), B, 1, dataset=table)
    assert _assert_matches(run, reference, range(STEPS)) == 0.0


def test_the_integrations_package_imports_no_framework():
    import subprocess
    import sys

    code = ("import sys, keyinit.integrations; "
            "print(sorted({'transformers', 'accelerate', 'lightning'} & set(sys.modules)))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert found.stdout.strip() == "[]"
