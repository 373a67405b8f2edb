"""What a capture cannot record, tried the ways careful users write it (issue 23): threads that were running
before the capture started (a pool a library keeps) drawing from torch's global RNG are refused with a
clear error naming the code, every global RNG as it was; deterministic work in such threads, a reseed in
the constructor and seeded generator objects run as in eager torch. A keyed sample's refused thread
draw reaches the reader even when the thread swallowed it."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import pytest
import torch
from torch import nn

import keyinit
from keyinit.data import keyed_samples, sample_index
from keyinit.errors import UnkeyedRandomnessError


def _states() -> tuple:
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def _built_with(values: Callable[[], object]) -> type:
    class Shuffled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("perm", torch.as_tensor(values()))

    return Shuffled


SEEDED = {
    "np.random.default_rng(0)": lambda: np.random.default_rng(0).permutation(4),
    "np.random.RandomState(0)": lambda: np.random.RandomState(0).permutation(4),
    "random.Random(0)": lambda: random.Random(0).sample(range(4), 4),
}


@pytest.mark.parametrize("how", list(SEEDED))
def test_a_seeded_generator_object_in_a_constructor_gives_the_eager_values(how):
    cls = _built_with(SEEDED[how])
    model = keyinit.deferred(cls)
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.perm, torch.as_tensor(SEEDED[how]()))


# ---------------------------------------------------------------- threads running before the capture


@pytest.fixture
def warm_pool():
    pool = ThreadPoolExecutor(2)
    list(pool.map(lambda _: None, range(4)))  # its threads run before any capture starts
    yield pool
    pool.shutdown()


def test_layers_built_in_a_pool_started_before_the_constructor_are_refused_with_torchs_rng_untouched(warm_pool):
    class PoolBuilt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(warm_pool.map(lambda _: nn.Linear(4, 4), range(2)))

    before = _states()
    with pytest.raises(UnkeyedRandomnessError, match=r"PoolBuilt\(\.\.\.\):.*torch's global RNG.*thread"):
        keyinit.deferred(PoolBuilt)  # the pool drew real weights from torch's RNG, kept as constants
    assert _same(before, _states())


def test_a_draw_in_a_pool_started_before_init_code_is_refused_and_nothing_written(warm_pool):
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()

    def init_method(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.copy_(warm_pool.submit(torch.randn, 4, 4).result())

    rng = torch.get_rng_state()
    with pytest.raises(UnkeyedRandomnessError, match="torch's global RNG"):
        keyinit.init_model(model, 0, init_method=init_method)
    assert torch.equal(model.weight, before) and torch.equal(rng, torch.get_rng_state())


def test_deterministic_work_in_such_a_pool_and_a_reseed_in_the_constructor_run_as_before(warm_pool):
    class Table(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1234)  # some constructors seed: harmless, the draws are keyed anyway
            self.lin = nn.Linear(4, 4)
            self.register_buffer("table", warm_pool.submit(lambda: torch.arange(4.0) * 2).result())

    model = keyinit.deferred(Table)
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.table, torch.arange(4.0) * 2)
    assert torch.initial_seed() == 1234  # what the constructor asked for, as in eager torch


# ---------------------------------------------------------------- keyed samples


class ThreadSwallows:
    """A dataset whose plain thread fails (its exception goes to threading's hook) and falls back."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        out: list[torch.Tensor] = []
        thread = threading.Thread(target=lambda: out.append(torch.rand(3)))
        thread.start()
        thread.join()
        return out[0] if out else torch.zeros(3)


def test_a_refused_draw_in_a_keyed_samples_thread_reaches_the_reader_even_if_the_thread_swallowed_it():
    data = keyed_samples(ThreadSwallows(), 0)
    rng = torch.get_rng_state()
    hook, threading.excepthook = threading.excepthook, lambda args: None
    try:
        with pytest.raises(UnkeyedRandomnessError, match="in a thread started while the sample was read"):
            data[sample_index(1, 0)]  # returned the fallback zeros before
    finally:
        threading.excepthook = hook
    assert torch.equal(rng, torch.get_rng_state())


def test_a_stand_in_used_in_a_pool_started_before_the_constructor_is_an_error_naming_threads(warm_pool):
    from keyinit._engine.capture.capture import CaptureError

    class ZeroedInPool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))
            warm_pool.submit(lambda: self.w.data.zero_()).result()

    with pytest.raises(CaptureError, match=r"ZeroedInPool\(\.\.\.\): .* in a thread that was running before"):
        keyinit.deferred(ZeroedInPool)


def test_after_that_refusal_the_reading_thread_draws_from_torch_again_and_captures_work():
    data = keyed_samples(ThreadSwallows(), 0)
    hook, threading.excepthook = threading.excepthook, lambda args: None
    try:
        with pytest.raises(UnkeyedRandomnessError):
            data[sample_index(1, 0)]
    finally:
        threading.excepthook = hook
    generator = torch.Generator().manual_seed(3)
    assert torch.equal(torch.rand(3, generator=generator), torch.rand(3, generator=torch.Generator().manual_seed(3)))
    model = keyinit.deferred(nn.Linear, 4, 4)  # the keyed sample's interception stayed on here: a SIGSEGV
    keyinit.materialize(model, 0, device="cpu")
    assert model.weight.isfinite().all()


class BuildsAModel:
    """A dataset whose item builds (and materializes) a small model, then augments."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        model = keyinit.deferred(nn.Linear, 3, 3)
        keyinit.materialize(model, 0, device="cpu")
        return model.weight.detach(), torch.rand(2)


def test_a_capture_inside_a_keyed_sample_keys_its_draws_itself():
    # the keyed sample's op kernels sit above the capture's mode: they wrote a draw through a stand-in (SIGSEGV)
    data = keyed_samples(BuildsAModel(), 0)
    (weight, noise), (weight_again, noise_again) = data[sample_index(1, 0)], data[sample_index(1, 0)]
    model = keyinit.deferred(nn.Linear, 3, 3)
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(weight, model.weight.detach()) and torch.equal(weight_again, weight)  # keyed as init
    assert torch.equal(noise, noise_again) and not torch.equal(noise, data[sample_index(2, 0)][1])  # per sample
