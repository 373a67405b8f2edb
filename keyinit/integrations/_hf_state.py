"""keyinit's data position in a Hugging Face ``Trainer`` checkpoint, and its check on resume.

:class:`KeyedDataState` is a ``TrainerCallback`` and an ``ExportableState``, so the Trainer itself writes
its state into every checkpoint's ``trainer_state.json`` (``stateful_callbacks``): a ``KeyedSampler``
``state_dict`` whose step is the optimizer step the checkpoint was saved at (not the sampler's own
counter, which DataLoader read-ahead and workers move past it) and whose fingerprint names the data
(size, seed, global batch, stream version, shuffling; any world size). :func:`saved_sampler_state` reads it
back from a checkpoint directory.

On resume the sampler starts at the first step of the checkpoint's pass over the data (its Trainer epoch)
and the Trainer's own fast-forward (``skip_first_batches``: batch indices only, no sample is read or
collated) skips the pass's steps already trained, so training continues at the saved step on any world
size. The saved fingerprint must match the resumed run's (a ``ValueError`` names what differs).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Optional

from transformers.trainer_callback import ExportableState, TrainerCallback

from keyinit.data import KeyedSampler

__all__ = ["KeyedDataState", "saved_sampler_state", "resume_sampler"]

#: The name the Trainer files the callback's state under (its class name).
STATE_NAME = "KeyedDataState"


class KeyedDataState(TrainerCallback, ExportableState):
    """The keyed sampler's position (the optimizer step) and fingerprint, in every Trainer checkpoint."""

    def __init__(self, fingerprint: Optional[dict] = None, step: int = 0) -> None:
        self.fingerprint, self.step = fingerprint, step

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step = state.global_step
        # a checkpoint of a run without this callback has no slot for its state: the Trainer's save needs one
        state.stateful_callbacks.setdefault(STATE_NAME, self.state())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step = state.global_step

    def state(self) -> dict:
        return {"args": {"fingerprint": self.fingerprint, "step": self.step}, "attributes": {}}


def saved_sampler_state(checkpoint: str) -> Optional[dict]:
    """The ``KeyedSampler.state_dict`` saved in Trainer checkpoint directory ``checkpoint``; None when the
    checkpoint has none (a run that was not keyed)."""
    path = os.path.join(checkpoint, "trainer_state.json")
    with open(path, encoding="utf-8") as f:
        saved = json.load(f).get("stateful_callbacks", {}).get(STATE_NAME)
    if saved is None:
        return None
    if isinstance(saved, list):
        saved = saved[-1]
    found = saved.get("args", {})
    if not isinstance(found.get("fingerprint"), dict):
        raise ValueError(f"{path}: the saved {STATE_NAME} has no sampler fingerprint: {saved!r}")
    return {"step": int(found["step"]), "stop": None, "fingerprint": found["fingerprint"]}


def resume_sampler(sampler: KeyedSampler, checkpoint: Optional[str], global_step: Optional[int],
                   ignore_data_skip: bool) -> None:
    """Place ``sampler`` for a Trainer resuming from ``checkpoint`` at optimizer step ``global_step``: at the
    first step of that step's pass, from which the Trainer skips to it (see the module docstring)."""
    if checkpoint is None:
        return
    saved = saved_sampler_state(checkpoint)
    step = global_step if saved is None else saved["step"]
    if saved is None:
        warnings.warn(f"keyinit: resuming from {checkpoint}, which holds no keyed data state (a run that was not "
                      f"keyed): the steps before it did not see keyinit's data order", stacklevel=3)
    else:
        try:
            sampler.load_state_dict(saved)  # the fingerprint: same data, seed, global batch and stream
        except ValueError as e:
            raise ValueError(f"resuming from {checkpoint}: {e}") from None
        if global_step is not None and step != global_step:
            raise ValueError(f"resuming from {checkpoint}: keyinit's saved data position is step {step}, the "
                             f"Trainer's global_step {global_step}")
    if ignore_data_skip and step % sampler.num_steps:
        raise ValueError(f"resuming from {checkpoint} at step {step}, inside a pass over the data, with "
                         f"ignore_data_skip=True: the Trainer would replay the pass's first batches under later "
                         f"optimizer steps. Keyed data skips by index only (no sample is read), so leave "
                         f"ignore_data_skip False")
    sampler.load_state_dict({"step": step - step % sampler.num_steps, "stop": None,
                             "fingerprint": sampler.fingerprint()})
