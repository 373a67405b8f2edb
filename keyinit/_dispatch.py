"""Chooses the implementation that fills a region: the one seam for fast kernels.

Every implementation must produce exactly the bits of
:func:`keyinit._reference.fill`; the tests hold them to it.
"""

from __future__ import annotations

import torch

from keyinit import _reference
from keyinit.distributions import Distribution
from keyinit.keys import Key
from keyinit.regions import Region

__all__ = ["fill"]


def fill(out: torch.Tensor, dist: Distribution, key: Key, region: Region) -> None:
    """Fill ``out`` (shaped like ``region``) with ``dist``'s values from ``key``'s stream."""
    if key.stream != "v1":  # pragma: no cover - guarded by Key's validator
        raise ValueError(f"no implementation for stream {key.stream!r}")
    if out.numel() == 0:
        return
    _reference.fill(out, dist, key, region)
