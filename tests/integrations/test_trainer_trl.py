"""TRL's ``SFTTrainer`` (a ``transformers.Trainer`` subclass) keyed with the same one call gives the same data, dropout
masks and losses for any split of its global batch into micro-batches.

``keyed_trainer(SFTTrainer(...))`` fine-tuning a tiny ``GPT2LMHeadModel`` (every dropout 0.1, built keyed from a config,
no hub) on a pre-tokenized ``datasets.Dataset`` of varying lengths, with SFTTrainer's own collator (``trl``'s
``DataCollatorForLanguageModeling``: each micro-batch padded to its own longest sample), its own loss (summed over the
step's tokens, divided by the Trainer's ``num_items_in_batch``) and a word-level tokenizer built locally. One process:
``per_device_train_batch_size=B`` (the reference) against ``B/2`` with ``gradient_accumulation_steps=2``, SFTConfig's
default gradient checkpointing on. Asserted per global sample ``(step, position)``: the real tokens and labels and every
dropout mask on them bitwise the reference's, each step's logged loss within 1e-5, the final parameters within 1e-4. The
control: the plain ``SFTTrainer`` on the same two layouts gives other losses. The recording and the model are
tests/integrations/test_trainer_keyed.py's.
"""

from __future__ import annotations

import warnings

import pytest

from tests._support.vision import define_torchvision_schemas

define_torchvision_schemas()  # transformers imports torchvision when it is installed
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

from keyinit.integrations.transformers import keyed_trainer  # noqa: E402
from tests.integrations.test_trainer_keyed import (  # noqa: E402
    B, N, SEED, STEPS, _assert_matches, _checked, _model, _params_differ, _RecordingMixin, _Sentences, _Tokenizer)


class _RecordingSFT(_RecordingMixin, trl.SFTTrainer):
    pass


def _sft(output_dir: str, micro: int, accumulate: int, keyed: bool = True, bf16: bool = False) -> dict:
    """An SFTTrainer run of STEPS steps; its records, logged losses and final parameters."""
    # SFTConfig's own defaults otherwise, gradient_checkpointing=True among them (each layer's forward run again
    # in the backward: its keyed masks drawn again, the same). bf16: SFTConfig's default is True; float32 here
    # so that losses compare to 1e-5 (test_sft_trainer_with_its_default_bf16 runs bf16)
    args = trl.SFTConfig(
        output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulate,
        max_steps=STEPS, learning_rate=1e-2, logging_steps=1, seed=SEED, use_cpu=True, report_to="none",
        disable_tqdm=True, save_strategy="no", max_length=None, bf16=bf16)
    table = datasets.Dataset.from_list([_Sentences()[i] for i in range(N)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _RecordingSFT(model=_model("clm"), args=args, train_dataset=table, processing_class=_Tokenizer())
    trainer.records = {"data": {}, "masks": {}}
    if keyed:
        keyed_trainer(trainer)
    trainer.train()
    losses = {e["step"] - 1: e["loss"] for e in trainer.state.log_history if "loss" in e}
    params = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {**trainer.records, "losses": losses, "params": params,
            "checkpointing": trainer.model.is_gradient_checkpointing}


def test_sft_trainer_micro_batches_and_accumulation_give_the_whole_batchs_run(tmp_path):
    reference = _checked(_sft(str(tmp_path / "one"), B, 1))
    assert reference["checkpointing"]  # SFTConfig's default: the layers' forwards run again in the backward
    split = _sft(str(tmp_path / "split"), B // 2, 2)
    print("max loss difference, SFTTrainer 2 micro-batches:", _assert_matches(split, reference, range(STEPS)))
    assert _params_differ(split["params"], reference["params"]) < 1e-4

    # the control: the plain SFTTrainer on the same two layouts trains on other data with other masks
    one, two = _sft(str(tmp_path / "plain-one"), B, 1, keyed=False), _sft(str(tmp_path / "plain-two"), B // 2, 2,
                                                                         keyed=False)
    assert max(abs(one["losses"][s] - two["losses"][s]) for s in range(STEPS)) > 1e-3


def test_sft_trainer_with_its_default_bf16(tmp_path):
    """SFTConfig's default bf16=True (CPU autocast around each forward; keyed attention dropout's backward then
    computes in bfloat16): the same data and dropout masks bitwise; losses to bfloat16's rounding."""
    reference = _checked(_sft(str(tmp_path / "one"), B, 1, bf16=True))
    split = _sft(str(tmp_path / "split"), B // 2, 2, bf16=True)
    print("max loss difference, bf16:", _assert_matches(split, reference, range(STEPS), loss_tolerance=1e-3))
