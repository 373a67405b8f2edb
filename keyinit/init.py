"""Initializers: keyed, element-local maps from a key to a parameter's values.

An initializer is called as ``init(key, target)`` and writes the values of
``target.region`` of a tensor of global shape ``target.global_shape`` into
``target.out``. Fans are always computed from the GLOBAL shape, never from a
local shard, so every layout produces the same values.

``element_local`` is False for initializers (``orthogonal``) that must draw
the whole tensor on every process to produce any region of it; init_model
flags those in its report.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from keyinit import random
from keyinit.keys import Key
from keyinit.layouts import Target

__all__ = ["Initializer", "normal"]


class Initializer:
    """Base class: ``__call__(key, target)`` fills ``target.out``."""

    element_local: ClassVar[bool] = True

    def __call__(self, key: Key, target: Target) -> None:
        raise NotImplementedError


@attrs.frozen
class normal(Initializer):  # noqa: N801 - named like torch.nn.init.normal_
    """``N(mean, std**2)``."""

    mean: float = 0.0
    std: float = 1.0

    def __call__(self, key: Key, target: Target) -> None:
        random.normal(key, target.global_shape, mean=self.mean, std=self.std, region=target.region, out=target.out)
