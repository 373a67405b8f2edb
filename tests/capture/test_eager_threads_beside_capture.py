"""A capture (``deferred``'s constructor, ``init_model``'s init code) in one thread and eager torch in another.

Demanding users build a teacher model eagerly, or run a second ``init_model``, in another thread while a
model is captured. The other thread is none of the capture's: its ops are neither recorded nor refused nor
changed (its values, and torch's global RNG after it, are what the same code gives with no keyinit running),
and the captured model gets bitwise the values it gets alone. Where the captured code's result holds tensors
made outside the capture while torch's global RNG moved, keyinit cannot tell whose draw it was: refused,
naming both possibilities.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch import nn

import keyinit
from keyinit.errors import UnkeyedRandomnessError

WAIT = 30.0  # seconds: a hang is a failure, not a stuck suite


def _set() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


class Paused(nn.Module):
    """A model whose constructor says when it runs and waits (inside a capture) until told to go on."""

    def __init__(self, inside: threading.Event, go_on: threading.Event) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        inside.set()
        assert go_on.wait(WAIT)
        self.b = nn.Linear(5, 3)
        nn.init.trunc_normal_(self.b.weight, std=0.02)


def init_code(inside: threading.Event, go_on: threading.Event):
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0, 0.02)
            nn.init.uniform_(module.bias, -0.1, 0.1)
        if isinstance(module, Plain):
            inside.set()
            assert go_on.wait(WAIT)

    return init


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)


def deferred_alone(seed: int) -> dict[str, torch.Tensor]:
    model = keyinit.deferred(Paused, threading.Event(), _set())
    keyinit.materialize(model, seed, device="cpu")
    return model.state_dict()


def init_model_alone(seed: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = Plain()
    model.to_empty(device="cpu")
    keyinit.init_model(model, seed, init_method=init_code(threading.Event(), _set()))
    return model.state_dict()


def eager_global() -> dict[str, torch.Tensor]:
    """An ordinary model built with torch's own init from the global RNG."""
    return {k: v.clone() for k, v in nn.Sequential(nn.Linear(7, 4), nn.Linear(4, 2)).state_dict().items()}


def eager_generator() -> dict[str, torch.Tensor]:
    """The same built on meta, then given torch's own init from its own generator."""
    generator = torch.Generator().manual_seed(21)
    model = nn.Sequential(nn.Linear(7, 4, device="meta"), nn.Linear(4, 2, device="meta")).to_empty(device="cpu")
    for layer in model:
        nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=generator)
        nn.init.uniform_(layer.bias, -1 / math.sqrt(layer.in_features), 1 / math.sqrt(layer.in_features),
                         generator=generator)
    return model.state_dict()


EAGER = {"global RNG": eager_global, "own generator": eager_generator}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _beside(capture, eager):
    """Run ``capture(inside, go_on)`` in one thread and, once it is inside, ``eager()`` in another;
    return (captured values, eager values, torch's RNG state after both, errors)."""
    inside, go_on = threading.Event(), threading.Event()
    out: dict = {}
    errors: list = []

    def first() -> None:
        try:
            out["captured"] = capture(inside, go_on)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            inside.set()

    def second() -> None:
        try:
            assert inside.wait(WAIT)
            out["eager"] = eager()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            go_on.set()

    threads = [threading.Thread(target=first, name="capturing"), threading.Thread(target=second, name="eager")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    return out, torch.get_rng_state(), errors


def _deferred(seed: int):
    def run(inside: threading.Event, go_on: threading.Event) -> dict[str, torch.Tensor]:
        model = keyinit.deferred(Paused, inside, go_on)
        keyinit.materialize(model, seed, device="cpu")
        return model.state_dict()

    return run


def _init_model(seed: int):
    def run(inside: threading.Event, go_on: threading.Event) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = Plain()
        model.to_empty(device="cpu")
        keyinit.init_model(model, seed, init_method=init_code(inside, go_on))
        return model.state_dict()

    return run


CAPTURES = {"deferred": (_deferred, deferred_alone), "init_model": (_init_model, init_model_alone)}


@pytest.mark.parametrize("how", list(EAGER))
@pytest.mark.parametrize("capture", list(CAPTURES))
def test_an_eager_model_built_in_another_thread_during_a_capture_is_untouched(capture, how):
    start = threading.Thread.start
    torch.manual_seed(77)
    expected = EAGER[how]()
    rng_after = torch.get_rng_state()
    torch.manual_seed(77)
    run, alone = CAPTURES[capture]
    out, rng, errors = _beside(run(5), EAGER[how])
    assert not errors, errors
    _same(out["eager"], expected)
    assert torch.equal(rng, rng_after)  # the eager thread's draws stand: nothing put back over them
    _same(out["captured"], alone(5))
    assert threading.Thread.start is start


def test_two_threads_each_building_eagerly_and_running_init_model_at_once_give_their_values_alone():
    torch.manual_seed(3)
    [Plain() for _ in range(2)]  # what the two builds draw from the global RNG, in whichever order
    rng_after = torch.get_rng_state()
    barrier = threading.Barrier(2, timeout=WAIT)
    models, errors = {}, []

    def run(seed: int) -> None:
        try:
            barrier.wait()
            model = Plain()  # torch's own init, global RNG: may run while the other thread captures
            keyinit.init_model(model, seed, init_method=init_code(threading.Event(), _set()))
            models[seed] = model.state_dict()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    torch.manual_seed(3)
    threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert not errors, errors
    for seed in (1, 2):
        _same(models[seed], init_model_alone(seed))
    assert torch.equal(torch.get_rng_state(), rng_after)  # both builds' draws stand, none put back


def test_two_deferred_builds_at_once_in_two_threads_give_their_values_alone():
    first_inside, second_inside = threading.Event(), threading.Event()
    models, errors = {}, []

    def run(seed: int, inside: threading.Event, go_on: threading.Event) -> None:
        try:
            models[seed] = _deferred(seed)(inside, go_on)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            inside.set()

    first = threading.Thread(target=run, args=(1, first_inside, second_inside))
    first.start()
    assert first_inside.wait(WAIT)
    second = threading.Thread(target=run, args=(2, second_inside, _set()))
    second.start()
    first.join(WAIT)
    second.join(WAIT)
    assert not errors, errors
    for seed in (1, 2):
        _same(models[seed], deferred_alone(seed))


class HoldsGiven(nn.Module):
    """A constructor that keeps a real tensor it was given and waits inside the capture."""

    def __init__(self, table: torch.Tensor, inside: threading.Event, go_on: threading.Event) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.register_buffer("table", table * 1)
        inside.set()
        assert go_on.wait(WAIT)


def test_when_keyinit_cannot_tell_whose_draw_it_was_the_capture_is_refused_naming_both():
    def run(inside: threading.Event, go_on: threading.Event):
        return keyinit.deferred(HoldsGiven, torch.arange(3.0), inside, go_on)

    out, _rng, errors = _beside(run, eager_global)
    assert "eager" in out  # the other thread ran as it would
    assert len(errors) == 1 and isinstance(errors[0], UnkeyedRandomnessError)
    message = str(errors[0])
    assert "HoldsGiven(...): torch's global RNG was drawn from" in message
    assert "another thread" in message and "made outside the capture" in message


class Reads:
    """A dataset whose ``__getitem__`` draws (keyed) and waits while it is read."""

    def __init__(self, inside: threading.Event, go_on: threading.Event) -> None:
        self.inside, self.go_on = inside, go_on

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        first = torch.rand(3)
        self.inside.set()
        assert self.go_on.wait(WAIT)
        return torch.cat([first, torch.randn(2)])


@pytest.mark.parametrize("how", list(EAGER))
def test_an_eager_model_built_in_another_thread_while_a_keyed_sample_is_read_is_untouched(how):
    from keyinit.data import keyed_samples

    torch.manual_seed(77)
    expected = EAGER[how]()
    rng_after = torch.get_rng_state()
    torch.manual_seed(77)
    out, rng, errors = _beside(lambda inside, go_on: keyed_samples(Reads(inside, go_on), 4, epoch=1)[2], EAGER[how])
    assert not errors, errors
    _same(out["eager"], expected)
    assert torch.equal(rng, rng_after)
    assert torch.equal(out["captured"], keyed_samples(Reads(threading.Event(), _set()), 4, epoch=1)[2])
