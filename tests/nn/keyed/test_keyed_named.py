"""keyed("name", ...): randomness of a training loop (diffusion noise and timesteps) keyed like a forward's."""

from __future__ import annotations

import pytest
import torch

import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError


def _noise(offset: int, latents: torch.Tensor, step: int = 3, stream: str = "v2"):
    with knn.keyed("diffusion.noise", 0, step=step, sample_offset=offset, inputs=(latents,), stream=stream):
        return torch.randn_like(latents), torch.randint(0, 1000, (latents.shape[0],)), torch.rand([])


def test_a_named_block_keys_per_sample_draws_by_global_sample_and_replicated_ones_by_call():
    latents = torch.ones(6, 4, 3)
    rng = torch.get_rng_state()
    noise, steps, shared = _noise(0, latents)
    for lo, hi in ((0, 2), (2, 6), (4, 6)):
        n, t, s = _noise(lo, latents[lo:hi])
        assert torch.equal(n, noise[lo:hi]) and torch.equal(t, steps[lo:hi]) and torch.equal(s, shared)
    assert torch.equal(rng, torch.get_rng_state())
    other = _noise(0, latents, step=4)
    assert not torch.equal(other[0], noise) and not torch.equal(other[1], steps)
    # the draws are the ones a module named "diffusion.noise" would make: ordinal 0, 1, 2 of that FQN
    # (under stream v1, whose names of a (6, 4, 3) tensor are its row-major indices)
    key = knn.dropout_key(0, step=3, fqn="diffusion.noise", ordinal=0)
    import keyinit.random as kr
    from keyinit.keys import fold_in
    assert torch.equal(_noise(0, latents, stream="v1")[0], kr.normal(fold_in(key, 0), (6, 4, 3)))


def test_a_named_block_refuses_a_draw_sized_by_a_plain_batch_size():
    latents = torch.ones(4, 2)
    with pytest.raises(UnkeyedRandomnessError, match="keyed block 'noise'"):
        with knn.keyed("noise", 0, step=0, inputs=(latents,)):
            torch.rand(int(latents.shape[0]))


@pytest.mark.parametrize("name,error", [("", ValueError), ("a..b", ValueError)])
def test_block_names_are_checked(name, error):
    with pytest.raises(error):
        knn.keyed(name, 0, step=0)
