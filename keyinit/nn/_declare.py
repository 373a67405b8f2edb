"""``keyinit.nn.batch_dim(tensor, dim)``: where a tensor's batch is, declared for :func:`keyinit.nn.keyed`."""

from __future__ import annotations

from typing import Optional

import torch

from keyinit.nn._batch import Batch, annotate, declare
from keyinit.nn._keyed import current_forward

__all__ = ["batch_dim"]


def batch_dim(tensor: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    """Declare where ``tensor``'s batch is for :func:`keyinit.nn.keyed`; returns ``tensor``.

    Before the forward (a model input): ``dim`` is the dimension that indexes the
    samples (``0`` is the default for every input whose dimension 0 has the batch's
    size), or ``None`` for an input that holds no batch (replicated: the same for
    every sample, e.g. a position table). Inside a keyed forward: the tensor's
    dimension ``dim`` holds the samples of the running forward, in order.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"batch_dim: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, int) or not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(f"batch_dim: dim must be None or a dimension of the {tensor.dim()}-D tensor, got {dim!r}")
        dim %= tensor.dim()
    declare(tensor, dim)
    forward = current_forward()
    if forward is not None:
        record = None if dim is None else Batch(dim, int(tensor.shape[dim]), forward.start)
        annotate(tensor, forward, record)
    return tensor
