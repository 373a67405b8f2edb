"""Activation checkpointing of functions under keyed(): ``keyinit.nn.checkpoint`` recomputes them keyed, and what
torch's own checkpoint of a function would recompute unseen is refused, never drawn from torch's generator.

A function checkpointed with ``torch.utils.checkpoint`` inside a module's forward is
recomputed in backward with keyed()'s modes off until it calls a module: its own
draws would come from torch's generator, and a module it calls on tensors it made
cannot be matched to its first execution (before, keyed() keyed such a module as a
new forward inside the block, by its dimension 0, and left it to torch after the
block: wrong gradients). The reference everywhere is the same model without
checkpointing, bit for bit.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import keyinit
import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError


class Model(nn.Module):
    """A draw before the checkpointed function, the function, and a draw after it."""

    def __init__(self, how: str, body: str, reentrant: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.2))
        self.how, self.body, self.reentrant = how, body, reentrant

    def fn(self, y: torch.Tensor) -> torch.Tensor:
        if self.body == "module after ops":  # a module of the model on a tensor the function made
            h = self.drop(y.tanh() * 2)
        elif self.body == "own draws":  # draws written in the function itself
            h = F.dropout(y.tanh(), 0.3, True) + torch.rand_like(y) * y.new_empty(y.shape[0], 1).bernoulli_(0.5)
        elif self.body == "modules and ops":  # ops between modules
            h = self.inner(self.drop(y) * 3)
        elif self.body == "layer first":  # one of torch.nn's layers that draw nothing, then a module that draws
            h = self.drop(self.lin(y))
        elif self.body == "numpy":  # a host generator, where the forward left it
            h = self.drop(y.tanh()) * float(np.random.rand())
        else:
            raise AssertionError(self.body)
        return (h * y).tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.lin(x))  # a draw before the region: the ordinals go on from it
        if self.how == "plain":
            out = self.fn(h)
        elif self.how == "torch":
            out = torch_checkpoint(self.fn, h, use_reentrant=self.reentrant)
        else:
            out = knn.checkpoint(self.fn, h, use_reentrant=self.reentrant)
        return self.drop(out)


def _grads(how: str, body: str, reentrant: bool, inside: bool, step: int = 1, in_thread: bool = False) -> list:
    model = Model(how, body, reentrant)
    keyinit.init_model(model, 0)
    x = torch.linspace(-1, 1, 6 * 16).reshape(6, 16).requires_grad_()
    rng, np_state = torch.get_rng_state(), np.random.get_state()[1].copy()
    with knn.keyed(model.train(), 3, step=step, host_random="forward"):
        loss = model(x).square().sum()
        if inside:
            loss.backward()
    if not inside:
        if in_thread:  # on CUDA the recompute runs in autograd's worker thread
            errors: list = []
            thread = threading.Thread(target=lambda: _run(loss.backward, errors))
            thread.start()
            thread.join()
            if errors:
                raise errors[0]
        else:
            loss.backward()
    assert torch.equal(rng, torch.get_rng_state())  # keyinit never draws from torch's generator
    assert np.array_equal(np_state, np.random.get_state()[1])
    return [x.grad] + [p.grad for p in model.parameters()]


def _run(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
        errors.append(exc)


def _assert_equal(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):  # (a parameter the body does not use has no gradient in either)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


BODIES = ["module after ops", "own draws", "modules and ops", "layer first", "numpy"]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("inside", [True, False])
def test_keyinit_checkpoint_recomputes_a_function_as_its_first_execution(body, reentrant, inside):
    expected = _grads("plain", body, reentrant, inside)
    got = _grads("keyinit", body, reentrant, inside)
    _assert_equal(got, expected)
    other = _grads("keyinit", body, reentrant, inside, step=2)  # the keys matter
    assert not torch.equal(other[0], expected[0])


@pytest.mark.parametrize("reentrant", [True, False])
def test_keyinit_checkpoint_recompute_in_another_thread(reentrant):
    expected = _grads("plain", "own draws", reentrant, inside=False)
    _assert_equal(_grads("keyinit", "own draws", reentrant, inside=False, in_thread=True), expected)


@pytest.mark.parametrize("reentrant", [True, False])
def test_torch_checkpoint_of_a_function_that_draws_is_refused_at_its_first_execution(reentrant):
    with pytest.raises(UnkeyedRandomnessError, match=r"the root module \(Model\): dropout\(p=0.3\) inside "
                                                     r"torch.utils.checkpoint \(or megatron's tensor_parallel."
                                                     r"checkpoint\) of a function .*keyinit.nn.checkpoint"):
        _grads("torch", "own draws", reentrant, inside=True)


@pytest.mark.parametrize("body", ["module after ops", "modules and ops", "layer first"])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("inside", [True, False])
def test_torch_checkpoint_recompute_of_a_module_it_cannot_match_is_refused(body, reentrant, inside):
    """Before: keyed as a new root forward by its dimension 0 inside the block, torch's own dropout after it."""
    with pytest.raises(UnkeyedRandomnessError, match=r"module '(drop|inner.1)' \(Dropout\): dropout\(p=0.[25]\) "
                                                     r"in backward: .*cannot match the recompute"):
        _grads("torch", body, reentrant, inside)


def test_torch_checkpoint_of_a_module_is_still_keyed():
    class Net(nn.Module):
        def __init__(self, how: str) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.4))
            self.how = how

        def forward(self, x):
            if self.how == "plain":
                return self.block(x)
            run = torch_checkpoint if self.how == "torch" else knn.checkpoint
            return run(self.block, x, use_reentrant=False)

    grads = {}
    for how in ("plain", "torch", "keyinit"):
        net = Net(how)
        keyinit.init_model(net, 0)
        x = torch.ones(4, 8, requires_grad=True)
        with knn.keyed(net.train(), 1, step=0):
            net(x).square().sum().backward()
        grads[how] = x.grad
    assert torch.equal(grads["torch"], grads["plain"]) and torch.equal(grads["keyinit"], grads["plain"])


def test_outside_keyed_it_is_torch_checkpoint():
    lin = nn.Linear(4, 4)
    x = torch.ones(2, 4, requires_grad=True)
    torch.manual_seed(0)
    a = knn.checkpoint(lambda t: F.dropout(lin(t), 0.5, True), x, use_reentrant=False)
    torch.manual_seed(0)
    b = torch_checkpoint(lambda t: F.dropout(lin(t), 0.5, True), x, use_reentrant=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("inside", [True, False])
def test_torch_checkpoint_sequential_of_torch_layers_is_keyed(reentrant, inside):
    """Segments that begin with one of torch.nn's layers that draw nothing (whose executions keyed() gives no
    frame inside a forward): under checkpointing they still get one, so the recompute is found again."""
    from torch.utils.checkpoint import checkpoint_sequential

    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        seq = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.GELU(), nn.Linear(8, 8), nn.Dropout(0.3))
        keyinit.init_model(seq, 0)
        x = torch.linspace(-1, 1, 5 * 8).reshape(5, 8).requires_grad_()
        with knn.keyed(seq.train(), 2, step=4):
            out = checkpoint_sequential(seq, 2, x, use_reentrant=reentrant) if checkpointed else seq(x)
            loss = out.square().sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append([x.grad] + [p.grad for p in seq.parameters()])
    _assert_equal(grads[1], grads[0])


def _megatron_checkpoint(monkeypatch):
    """megatron-core's activation checkpointing (its CheckpointFunction, as megatron's layers call it) on this
    CPU-only machine: its CUDA generator states are not saved and set (nothing else of it changes)."""
    random = pytest.importorskip("megatron.core.tensor_parallel.random")
    monkeypatch.setattr(random, "_get_all_rng_states", lambda: (None, None, None))
    monkeypatch.setattr(random, "_set_all_rng_states", lambda *states: None)
    return random.checkpoint


class _MegatronStyle(nn.Module):
    def __init__(self, checkpoint, direct: bool) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(8, 8), nn.Dropout(0.3)
        self.checkpoint, self.direct = checkpoint, direct

    def forward(self, x):
        h = self.lin(x)

        def body(y):
            if self.direct:  # a draw written in the checkpointed function itself
                return F.dropout(y, 0.3, True) * 2
            return self.drop(y)  # a layer of the model: recomputed by its hooks, keyed

        if self.checkpoint is None:
            return body(h)
        return self.checkpoint(body, False, h)


def test_megatron_checkpoint_of_a_function_that_draws_is_refused(monkeypatch):
    checkpoint = _megatron_checkpoint(monkeypatch)
    torch.manual_seed(0)
    model = _MegatronStyle(checkpoint, direct=True).train()
    with pytest.raises(UnkeyedRandomnessError, match=r"dropout\(p=0.3\) inside torch.utils.checkpoint \(or "
                                                     r"megatron's tensor_parallel.checkpoint\)"):
        with knn.keyed(model, 3, step=1):
            model(torch.randn(4, 8))


def test_megatron_checkpoint_of_a_layer_is_keyed(monkeypatch):
    checkpoint = _megatron_checkpoint(monkeypatch)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    grads = []
    for with_checkpoint in (False, True):
        torch.manual_seed(0)
        model = _MegatronStyle(checkpoint if with_checkpoint else None, direct=False).train()
        with knn.keyed(model, 3, step=1):
            model(x).pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    _assert_equal(grads[1], grads[0])
