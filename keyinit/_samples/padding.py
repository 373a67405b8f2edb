"""Left padding, where keyinit can see it: a collated batch whose ``attention_mask`` has padding before
a real token in some row gets a :class:`keyinit.errors.LeftPaddingWarning` (docs/dropout.md, "Padding
and packing").

keyinit names a random value by the coordinates of its element within its sample: ``keyed_collate``
by the element's place in its row (docs/spec.md 16.4), a keyed forward by its coordinates in the
sample (14.8; 14.4-14.7 by its row-major index). Padding before a real token moves it to another
coordinate, by an amount that, with dynamic padding, depends on the batch's longest sample; so its
values change with the batch it lands in. keyinit does not key by the token's real position instead:
it tracks which dimension of an activation holds the samples, not which holds the sequence (a hidden
state ``(L, D)``, attention probabilities ``(H, Lq, Lk)`` with two shifted dimensions, a merged
``(L * D)``), so any shift it applied would be a guess. It warns, and the fix is the user's: pad on the
right, or pad every batch to one fixed length (then every real token has one coordinate in every batch).

Two places look: ``keyed_collate`` at the batch its collate function returns (on the CPU, where it is
made), and ``keyed(samples=batch)`` at the batch a forward is keyed by. ``keyed_collate`` marks the batch
it checked (the attribute ``keyinit_left_padding``: the id of the process that warned, ``0`` for a batch
without left padding), so ``keyed(samples=)`` neither reads the mask again (no device synchronization for
a batch moved to an accelerator) nor repeats a warning the same process gave; a batch collated in a
DataLoader worker is reported there and again in the process that runs the forward. Only a mapping's
``"attention_mask"`` entry of two dimensions ``(rows, length)`` is read; anything else is not looked at.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any, Optional

import torch

from keyinit.errors import LeftPaddingWarning

__all__ = ["MARK", "COLLATE_MESSAGE", "KEYED_MESSAGE", "left_padded", "check_collated", "check_samples"]

#: The attribute ``keyed_collate`` leaves on a batch it checked (see the module docstring).
MARK = "keyinit_left_padding"

_FIX = ('pad on the right (tokenizer.padding_side = "right"; DataCollatorWithPadding and '
        "DataCollatorForLanguageModeling pad on the tokenizer's side), or pad every batch to one fixed length "
        "(docs/dropout.md, \"Padding and packing\")")

COLLATE_MESSAGE = (
    "keyed_collate: the collate function returned a left-padded batch (its attention_mask has padding before "
    "a real token). keyed_collate keys a row's draws by their place in the row, and keyed() a forward's "
    "random values by their coordinates in the sample, so a real token after padding gets the values of "
    "another place, which with dynamic padding depend on how far its batch is padded: " + _FIX)

KEYED_MESSAGE = (
    "keyed(samples=): the batch's attention_mask has padding before a real token (left padding). keyed() "
    "names a random value by its coordinates within its sample (not by the token's position in the text), so "
    "a real token after padding gets another coordinate's masks, which with dynamic padding depend on how "
    "far its batch is padded (stream v2, docs/spec.md 14.8, leaves a sample's masks alone only under right "
    "padding): " + _FIX)


def _attention_mask(batch: Any) -> Optional[torch.Tensor]:
    """``batch["attention_mask"]`` as a ``(rows, length)`` tensor, or None (not a mapping, no such entry,
    another shape, not a tensor or an array of numbers)."""
    if not isinstance(batch, Mapping):
        return None
    try:
        mask = batch["attention_mask"]
    except (KeyError, TypeError):
        return None
    if not isinstance(mask, torch.Tensor):
        try:
            mask = torch.as_tensor(mask)  # a list of lists or a numpy array (return_tensors="np" or None)
        except (TypeError, ValueError, RuntimeError):
            return None
    if mask.dim() != 2 or mask.is_complex() or mask.device.type == "meta":
        return None
    return mask


def left_padded(batch: Any) -> Optional[bool]:
    """Whether ``batch["attention_mask"]`` has, in some row, a 0 (padding) before a non-zero entry (a real
    token); None where there is no such ``(rows, length)`` mask to read."""
    mask = _attention_mask(batch)
    if mask is None:
        return None
    real = mask != 0
    return bool((real[:, 1:] & ~real[:, :-1]).any()) if real.shape[1] > 1 else False


def _mark(batch: Any, value: int) -> None:
    try:
        object.__setattr__(batch, MARK, value)
    except (AttributeError, TypeError):
        pass  # (a plain dict: keyed(samples=) reads its mask itself)


def check_collated(batch: Any) -> Any:
    """``keyed_collate``'s check of what its collate function returned: warn if it is left-padded, and
    mark it as checked (see the module docstring). Returns ``batch``."""
    found = left_padded(batch)
    if found is None:
        return batch
    if found:
        warnings.warn(COLLATE_MESSAGE, LeftPaddingWarning, stacklevel=3)  # (the collate call's caller)
    _mark(batch, os.getpid() if found else 0)
    return batch


def check_samples(samples: Any) -> None:
    """``keyed(samples=batch)``'s check: warn if the batch is left-padded, unless ``keyed_collate`` found it
    not left-padded or already warned about it in this process."""
    try:
        marked = object.__getattribute__(samples, "__dict__").get(MARK)
    except AttributeError:
        marked = None
    if marked is None:
        if not left_padded(samples):
            return
    elif marked == 0 or marked == os.getpid():
        return
    warnings.warn(KEYED_MESSAGE, LeftPaddingWarning, stacklevel=4)  # (the line that called keyed)
