"""A Hugging Face ``Trainer`` keyed with one call: ``trainer = keyed_trainer(trainer)``.

What changes, with the user's ``TrainingArguments`` as they are (``docs/trainer.md``):

- data order: a :class:`keyinit.data.KeyedSampler` in place of the Trainer's sampler, its global batch
  ``per_device_train_batch_size * gradient_accumulation_steps * world size`` the same samples for every
  layout (:mod:`keyinit.integrations._hf_data`); seeded by ``data_seed`` (else ``seed``);
- collate: the Trainer's ``data_collator`` wrapped in ``keyed_collate`` (MLM masks per sample, dynamic
  padding included) over ``keyed_samples(train_dataset)``;
- forward randomness: each ``training_step`` (forward and backward of one micro-batch) inside
  ``keyinit.nn.keyed(model, seed, step=state.global_step, samples=<the batch's positions>)``;
- checkpoints: the data position in the Trainer's ``trainer_state.json``, checked and continued on resume
  at any world size (:mod:`keyinit.integrations._hf_state`).

Evaluation and prediction are the Trainer's own (no sampler, collate or forward of theirs is touched), and
nothing is added to the model: ``save_model`` writes what it would without keyinit.

:func:`keyed_trainer` gives the trainer object the class ``Keyed<its class>``, a subclass of its own with
:class:`KeyedTrainerMixin` first, so a ``Trainer`` subclass keeps its own overrides.
Subclassing ``KeyedTrainerMixin`` and a Trainer class by hand does the same
(``class MyTrainer(KeyedTrainerMixin, Trainer)``, then ``keyed_trainer(MyTrainer(...))`` to set the seeds).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

import keyinit.nn as knn
from keyinit.data import KeyedSampler, sample_positions
from keyinit.integrations._hf_data import keyed_train_dataloader
from keyinit.integrations._hf_state import KeyedDataState, resume_sampler, saved_sampler_state
from keyinit.keys import as_int_in

__all__ = ["keyed_trainer", "KeyedTrainerMixin", "KeyedDataState", "saved_sampler_state"]


class KeyedTrainerMixin:
    """The keyed parts of a ``transformers.Trainer`` (see the module docstring); set up by :func:`keyed_trainer`."""

    keyinit_seed: int
    keyinit_data_seed: int
    keyinit_stream: str
    keyinit_sampler: Optional[KeyedSampler] = None
    _keyinit_resume: Optional[str] = None

    def get_train_dataloader(self) -> Any:
        self._keyinit_check()
        loader, sampler = keyed_train_dataloader(self, self.keyinit_data_seed)
        self.keyinit_sampler = sampler
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, KeyedDataState):
                callback.fingerprint = sampler.fingerprint()
        resume = self._keyinit_resume
        if resume is not None:
            step = _checkpoint_step(resume)
            resume_sampler(sampler, resume, step, self.args.ignore_data_skip)
        return loader

    def training_step(self, model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        positions = sample_positions(inputs)
        if positions is None:
            raise TypeError(
                f"keyinit.integrations.transformers: the training batch ({type(inputs).__name__}) does not carry its "
                f"samples' positions; it did not come from the keyed train DataLoader (get_train_dataloader was "
                f"overridden after keyed_trainer, or the batch was rebuilt before training_step)")
        with knn.keyed(model, self.keyinit_seed, step=self.state.global_step, samples=positions,
                       stream=self.keyinit_stream):
            return super().training_step(model, inputs, *args, **kwargs)  # type: ignore[misc]

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._keyinit_resume = _resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._keyinit_resume = None

    def _keyinit_check(self) -> None:
        if getattr(self, "keyinit_seed", None) is None:
            raise TypeError(f"{type(self).__name__} mixes in KeyedTrainerMixin but was not set up: call "
                            f"keyinit.integrations.transformers.keyed_trainer(trainer) on it")


def _resolve_checkpoint(resume: Any, output_dir: str) -> Optional[str]:
    """The checkpoint directory ``Trainer.train(resume_from_checkpoint=resume)`` loads (None: a fresh run)."""
    if resume is None or resume is False:
        return None
    if resume is True:
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(output_dir)  # (None: the Trainer raises its own error)
    return os.fspath(resume)


def _checkpoint_step(checkpoint: str) -> Optional[int]:
    from transformers.trainer_callback import TrainerState

    path = os.path.join(checkpoint, "trainer_state.json")
    return TrainerState.load_from_json(path).global_step if os.path.isfile(path) else None


_CLASSES: dict[type, type] = {}


def _keyed_class(cls: type) -> type:
    if issubclass(cls, KeyedTrainerMixin):
        return cls
    found = _CLASSES.get(cls)
    if found is None:
        found = _CLASSES[cls] = type(f"Keyed{cls.__name__}", (KeyedTrainerMixin, cls),
                                     {"__module__": __name__, "__doc__": cls.__doc__})
    return found


def keyed_trainer(trainer: Any, seed: Optional[int] = None, *, data_seed: Optional[int] = None,
                  stream: str = "v2") -> Any:
    """Key ``trainer`` (a ``transformers.Trainer``, not yet trained) in place, and return it.

    ``seed``: the root of the forwards' randomness (dropout; ``keyinit.nn.keyed``), default
    ``args.seed``. ``data_seed``: the data order's and the collate's, default ``args.data_seed``, else
    ``args.seed``. ``stream``: the forwards' stream version (``"v2"``: a sample's masks do not depend on
    how far its batch is padded; ``docs/spec.md`` 14.8). The model's init is not the Trainer's: build it
    keyed before (``keyinit.deferred`` then ``keyinit.materialize``; ``docs/trainer.md``).
    """
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise TypeError(f"keyed_trainer: expected a transformers.Trainer, got {type(trainer).__name__}")
    if getattr(trainer, "keyinit_seed", None) is not None:
        raise ValueError("keyed_trainer: this trainer is keyed already")
    overridden = [name for name in ("get_train_dataloader", "_get_train_sampler")
                  if getattr(type(trainer), name) is not getattr(Trainer, name)
                  and not isinstance(trainer, KeyedTrainerMixin)]
    if overridden:
        raise ValueError(f"keyed_trainer: {type(trainer).__name__} overrides {' and '.join(overridden)}; keyinit "
                         f"builds the train DataLoader itself (KeyedSampler, keyed_collate), so that override would be "
                         f"bypassed. Keep the override's data in train_dataset and data_collator instead")
    if stream not in ("v1", "v2"):
        raise ValueError(f"keyed_trainer: stream must be 'v1' or 'v2', got {stream!r}")
    args = trainer.args
    seed = args.seed if seed is None else seed
    data_seed = (args.data_seed if args.data_seed is not None else args.seed) if data_seed is None else data_seed
    trainer.keyinit_seed = as_int_in(seed, "keyed_trainer seed", 0)
    trainer.keyinit_data_seed = as_int_in(data_seed, "keyed_trainer data_seed", 0)
    trainer.keyinit_stream = stream
    trainer.__class__ = _keyed_class(type(trainer))
    if not any(isinstance(c, KeyedDataState) for c in trainer.callback_handler.callbacks):
        trainer.add_callback(KeyedDataState())
    return trainer
