"""Small models the tests share, each the smallest that shows one thing (their FQNs are part of what they show).

- :class:`TwoLinears`: two ``nn.Linear`` named ``a`` and ``b`` (plans, rules, init methods).
- :func:`linear_dropout`: ``nn.Sequential(Linear, Dropout)``, the smallest model that draws (``0``, ``1``).
- :class:`DropPathBlock`: a residual block drawing twice, element-wise (``nn.Dropout``) and per sample
  (a DropPath-style ``bernoulli_`` keep, rescaled); :class:`BlockStack`: such blocks in ``layers``, an
  ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... (torchtitan's layout: a pipeline stage deletes the blocks it
  does not hold and keeps the full model's FQNs).
"""

from __future__ import annotations

import torch
from torch import nn


class TwoLinears(nn.Module):
    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def linear_dropout(dim: int = 4, p: float = 0.5) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, dim), nn.Dropout(p))


class DropPathBlock(nn.Module):
    def __init__(self, dim: int = 8, p: float = 0.3, keep: float = 0.75) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)
        self.keep = keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(self.keep)  # one per sample
        return x + self.drop(torch.relu(self.proj(x))) * keep / self.keep


class BlockStack(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 4, p: float = 0.3, keep: float = 0.75) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): DropPathBlock(dim, p, keep) for i in range(depth)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x
