"""numpy.random and Python's random inside a keyed forward: seeded from the root forward's key, restored after."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

import keyinit.nn as knn
from keyinit.keys import fold_in
from keyinit.nn._keys import keyed_module_key


class SpecAugmentLike(nn.Module):
    """Draws its masks on the host, as HF's _compute_mask_indices does (np.random) plus Python's random."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        starts = np.random.randint(0, x.shape[1], size=x.shape[0])
        scale = random.random()
        mask = torch.ones_like(x)
        for row, start in enumerate(starts):
            mask[row, int(start)] = 0
        return x * mask * scale


def _run(step: int) -> torch.Tensor:
    with knn.keyed(model := SpecAugmentLike(), 5, step=step):
        return model(torch.ones(4, 6))


def test_host_generators_are_keyed_per_forward_and_left_as_they_were():
    np.random.seed(1)
    random.seed(1)
    np_state, py_state = np.random.get_state(), random.getstate()
    first = _run(0)
    assert random.getstate() == py_state
    after = np.random.get_state()
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(after, np_state))
    np.random.seed(123)  # another global state: the same keyed values
    random.seed(123)
    assert torch.equal(_run(0), first)
    assert not torch.equal(_run(1), first)  # another step: other values


def test_host_key_derivation():
    """numpy is seeded with fold_in(K, 'numpy.random') of K = fold_in(module key of the root, 'host')."""
    seen = {}

    class Probe(nn.Module):
        def forward(self, x):
            seen["np"] = np.random.randint(0, 2**31, size=3)
            seen["py"] = random.random()
            return x

    with knn.keyed(model := Probe(), 5, step=2):
        model(torch.ones(2))
    k = fold_in(keyed_module_key(knn.Keyed(model, 5, 2, None).root, 2, ""), "host")
    kn, kp = fold_in(k, "numpy.random"), fold_in(k, "python.random")
    assert np.array_equal(seen["np"], np.random.RandomState([kn.k0, kn.k1]).randint(0, 2**31, size=3))
    assert seen["py"] == random.Random(kp.k0 | (kp.k1 << 32)).random()
