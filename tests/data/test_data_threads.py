"""A keyed sample's __getitem__ that augments in threads it starts: their draws are refused, not left to
torch's global RNG (each read of the item would differ)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from keyinit.data import keyed_samples, sample_index
from keyinit.errors import UnkeyedRandomnessError


class Threaded:
    def __init__(self, draw: bool) -> None:
        self.draw = draw

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        work = (lambda: torch.rand(3)) if self.draw else (lambda: torch.arange(3.0) * i)
        with ThreadPoolExecutor(2) as pool:
            return torch.stack(list(pool.map(lambda _: work(), range(2))))


def test_a_draw_in_a_thread_started_by_a_keyed_sample_is_refused():
    data = keyed_samples(Threaded(draw=True), 0)
    rng = torch.get_rng_state()
    with pytest.raises(UnkeyedRandomnessError, match="in a thread started while the sample was read"):
        data[sample_index(3, 0)]
    assert torch.equal(rng, torch.get_rng_state())


def test_deterministic_work_in_threads_runs_and_threads_after_the_read_are_free():
    data = keyed_samples(Threaded(draw=False), 0)
    assert torch.equal(data[sample_index(3, 0)], torch.stack([torch.arange(3.0) * 3] * 2))
    with ThreadPoolExecutor(1) as pool:  # outside a keyed read, a thread draws as usual
        assert pool.submit(lambda: torch.rand(2, generator=torch.Generator().manual_seed(0))).result().shape == (2,)
