"""The thread watching of captures and keyed samples looks only at the threads their own code starts.

A capture (``init_model``'s init code, ``deferred``'s constructor) and a keyed ``__getitem__`` refuse
draws in the threads they start. A thread that unrelated code starts meanwhile (a loader drawing from its
own generator, a second ``materialize`` in its own thread) is none of theirs: it runs as it would, and
both sides give the values they give alone. ``threading.Thread.start`` is as found once no block is open.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import keyinit
from keyinit.data import keyed_samples
from keyinit.errors import UnkeyedRandomnessError

WAIT = 30.0  # seconds: a hang is a failure, not a stuck suite


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)


def init_code(inside: threading.Event, go_on: threading.Event):
    """Init code that says when it runs and waits (in the capture) until told to go on."""

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0, 0.02)
            nn.init.zeros_(module.bias)
        if isinstance(module, Net):
            inside.set()
            assert go_on.wait(WAIT)

    return init


def alone(seed: int) -> dict[str, torch.Tensor]:
    """``init_model``'s values of a :class:`Net` with :func:`init_code`, run with no other thread."""
    model = Net()
    keyinit.init_model(model, seed, init_method=init_code(threading.Event(), _set()))
    return model.state_dict()


def _set() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def assert_same(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


def test_a_thread_other_code_starts_during_init_code_is_not_refused():
    start = threading.Thread.start
    inside, go_on, drawn, errors = threading.Event(), threading.Event(), [], []

    def loader() -> None:  # other code, running before init_model: starts a worker while the capture runs
        assert inside.wait(WAIT)

        def work() -> None:
            try:
                drawn.append(torch.randn(4, generator=torch.Generator().manual_seed(11)))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        worker = threading.Thread(target=work, name="loader-worker")
        worker.start()
        worker.join(WAIT)
        go_on.set()

    other = threading.Thread(target=loader)
    other.start()
    model = Net()
    keyinit.init_model(model, 3, init_method=init_code(inside, go_on))
    other.join(WAIT)
    assert not errors, errors
    assert torch.equal(drawn[0], torch.randn(4, generator=torch.Generator().manual_seed(11)))
    assert_same(model, alone(3))
    assert threading.Thread.start is start


def test_two_materializes_in_two_threads_give_their_values_alone():
    start = threading.Thread.start
    first_inside, second_inside = threading.Event(), threading.Event()
    models, errors = {}, []

    def run(seed: int, inside: threading.Event, go_on: threading.Event) -> None:
        try:
            with torch.device("meta"):  # reset_parameters runs its (meta) draws in this thread
                model = Net()
            keyinit.materialize(model, seed, init_method=init_code(inside, go_on), device="cpu")
            models[seed] = model
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            inside.set()

    first = threading.Thread(target=run, args=(1, first_inside, second_inside))
    first.start()
    assert first_inside.wait(WAIT)  # the first capture is open (and waits for the second) ...
    second = threading.Thread(target=run, args=(2, second_inside, _set()))
    second.start()  # ... when the second thread is started
    first.join(WAIT)
    second.join(WAIT)
    assert not errors, errors
    for seed in (1, 2):
        with torch.device("meta"):
            reference = Net()
        keyinit.materialize(reference, seed, init_method=init_code(threading.Event(), _set()), device="cpu")
        assert_same(models[seed], reference.state_dict())
    assert not torch.equal(models[1].a.weight, models[2].a.weight)
    assert threading.Thread.start is start


class Grandchild(nn.Module):
    """A constructor whose worker thread starts another thread that draws."""

    def __init__(self, out: list) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)

        def draw() -> None:
            try:
                out.append(torch.rand(2))
            except UnkeyedRandomnessError as exc:
                out.append(exc)

        def child() -> None:
            grandchild = threading.Thread(target=draw, name="grandchild")
            grandchild.start()
            grandchild.join()

        thread = threading.Thread(target=child)
        thread.start()
        thread.join()


def test_a_thread_started_by_a_thread_the_constructor_started_is_refused_too():
    out: list = []
    state = torch.get_rng_state()
    with pytest.raises(UnkeyedRandomnessError, match=r"in a thread it started \(grandchild\)"):
        keyinit.deferred(Grandchild, out)
    assert isinstance(out[0], UnkeyedRandomnessError)
    assert torch.equal(state, torch.get_rng_state())


class Reads:
    """A dataset whose ``__getitem__`` draws (keyed) and lets the test act while it is read."""

    def __init__(self, inside: threading.Event, go_on: threading.Event) -> None:
        self.inside, self.go_on = inside, go_on

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        out = torch.rand(3)
        self.inside.set()
        assert self.go_on.wait(WAIT)
        return out


def test_a_thread_other_code_starts_while_a_keyed_sample_is_read_is_not_refused():
    start = threading.Thread.start
    inside, go_on, drawn, errors = threading.Event(), threading.Event(), [], []

    def other() -> None:
        assert inside.wait(WAIT)

        def work() -> None:
            try:
                drawn.append(torch.rand(2, generator=torch.Generator().manual_seed(5)))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        worker = threading.Thread(target=work)
        worker.start()
        worker.join(WAIT)
        go_on.set()

    thread = threading.Thread(target=other)
    thread.start()
    value = keyed_samples(Reads(inside, go_on), 0, epoch=0)[2]
    thread.join(WAIT)
    assert not errors, errors
    assert torch.equal(drawn[0], torch.rand(2, generator=torch.Generator().manual_seed(5)))
    assert torch.equal(value, keyed_samples(Reads(threading.Event(), _set()), 0, epoch=0)[2])
    assert threading.Thread.start is start


class PoolBuilt(nn.Module):
    """A constructor that loads (deterministic work) in a pool it keeps alive after it returns."""

    def __init__(self, pools: list) -> None:
        super().__init__()
        pool = ThreadPoolExecutor(2)
        pools.append(pool)
        self.a = nn.Linear(3, 3)
        self.register_buffer("table", pool.submit(lambda: torch.arange(6.0).reshape(2, 3) * 2).result())


def test_threading_is_as_found_after_the_block_though_threads_it_started_live_on():
    start, pools = threading.Thread.start, []
    model = keyinit.deferred(PoolBuilt, pools)
    assert threading.Thread.start is start  # the pool's worker still lives
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.table, torch.arange(6.0).reshape(2, 3) * 2)
    assert pools[0].submit(lambda: torch.rand(2, generator=torch.Generator().manual_seed(1))).result().shape == (2,)
    pools[0].shutdown()
