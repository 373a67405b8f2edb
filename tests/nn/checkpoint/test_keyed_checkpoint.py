"""Activation checkpointing under keyed(): the recompute in backward() draws the first execution's masks.

Reentrant (``use_reentrant=True``: the recompute gets detached copies of the
inputs, autograd off in the first execution) and non-reentrant checkpointing,
with ``backward()`` inside the keyed block or after it (the checkpoints hold
the context for the recomputes of its forwards; nothing stays on the model:
tests/nn/checkpoint/test_keyed_checkpoint_lifecycle.py): the gradients equal those of the
same model without checkpointing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import keyinit
import keyinit.nn as knn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = x.new_empty((x.shape[0], 1)).bernoulli_(0.7)  # per-sample, DropPath-style
        return x + self.drop(torch.relu(self.proj(x))) * keep


class Net(nn.Module):
    def __init__(self, reentrant=None) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) if self.reentrant is None else checkpoint(layer, x, use_reentrant=self.reentrant)
        return x


def _grads(reentrant, backward_inside: bool, step: int = 1, device: str = "cpu"):
    net = Net(reentrant).to(device)
    keyinit.init_model(net, 0)
    x = torch.linspace(-1, 1, 6 * 8, device=device).reshape(6, 8).requires_grad_()
    rng = torch.get_rng_state()
    with knn.keyed(net.train(), 3, step=step):
        loss = net(x).square().sum()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    assert torch.equal(rng, torch.get_rng_state())  # checkpointing saves and restores it; keyinit never draws
    return [x.grad] + [p.grad for p in net.parameters()]


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("backward_inside", [True, False])
def test_checkpoint_recompute_uses_the_first_executions_keys(reentrant, backward_inside):
    expected = _grads(None, True)
    got = _grads(reentrant, backward_inside)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the masks matter: another step's keys give other gradients
    other = _grads(reentrant, backward_inside, step=2)
    assert not torch.allclose(other[0], expected[0])


def test_after_the_block_only_recomputes_are_keyed():
    net = Net(reentrant=True)
    keyinit.init_model(net, 0)
    x = torch.ones(4, 8, requires_grad=True)
    with knn.keyed(net.train(), 3, step=1):
        loss = net(x).sum()
    # a plain forward after the block is not keyed (torch's own dropout, the global RNG)
    torch.manual_seed(0)
    a = Net.forward(net, x)
    torch.manual_seed(0)
    b = Net.forward(net, x)
    assert torch.equal(a, b)
    loss.backward()  # the recomputes are keyed: no error, and the next keyed() takes over cleanly
    with knn.keyed(net, 3, step=2):
        net(x).sum().backward()
    assert not net.layers[0]._forward_pre_hooks or len(net.layers[0]._forward_pre_hooks) == 1


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_recompute_in_another_thread_is_keyed_as_its_first_execution(reentrant):
    """On CUDA the recompute runs in autograd's worker thread: here backward() runs in another thread."""
    import threading

    expected = _grads(None, True)
    net = Net(reentrant)
    keyinit.init_model(net, 0)
    x = torch.linspace(-1, 1, 6 * 8).reshape(6, 8).requires_grad_()
    with knn.keyed(net.train(), 3, step=1):
        loss = net(x).square().sum()
    errors: list = []

    def backward() -> None:
        try:
            loss.backward()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    assert not errors, errors
    for a, b in zip([x.grad] + [p.grad for p in net.parameters()], expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_without_checkpointing_nothing_is_left_on_the_model_after_the_block():
    import io

    net = Net(reentrant=None)
    keyinit.init_model(net, 0)
    x = torch.ones(4, 8)
    with knn.keyed(net.train(), 3, step=1):
        out = net(x)  # noqa: F841 - its tensors stay alive after the block
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())
    torch.save(net, io.BytesIO())  # a model with keyinit's closures as hooks would not pickle


class HostScaled(nn.Module):
    """A layer that draws from numpy.random (a host-side augmentation) in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        mask = torch.from_numpy((np.random.rand(*x.shape) > 0.3).astype(np.float32))  # saved for backward
        return self.proj(x * mask)


class HostNet(nn.Module):
    def __init__(self, reentrant=None) -> None:
        super().__init__()
        self.layers = nn.ModuleList([HostScaled() for _ in range(2)])
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) if self.reentrant is None else checkpoint(layer, x, use_reentrant=self.reentrant)
        return x


def _host_grads(model: nn.Module, outer_checkpoint=None, backward_inside: bool = True) -> list:
    keyinit.init_model(model, 0)
    x = torch.linspace(-1, 1, 8).reshape(1, 8).requires_grad_()  # one sample: host draws are keyed
    with knn.keyed(model.train(), 3, step=1):
        out = model(x) if outer_checkpoint is None else checkpoint(model, x, use_reentrant=outer_checkpoint)
        loss = out.square().sum()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("backward_inside", [True, False])
def test_a_recomputed_module_draws_what_its_first_execution_drew_from_numpy(reentrant, backward_inside):
    """The recompute of layers.1 resumes numpy's stream where its first execution began (after layers.0's
    draw), not from the forward's seed: the gradients are those without checkpointing."""
    expected = _host_grads(HostNet(None))
    got = _host_grads(HostNet(reentrant), backward_inside=backward_inside)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    got = _host_grads(HostNet(None), outer_checkpoint=reentrant, backward_inside=backward_inside)  # the root
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _hf_grads(model_type: str, class_name: str, reentrant, backward_inside: bool) -> dict:
    transformers = pytest.importorskip("transformers")
    from tests._support.hf_arch import tiny_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, class_name)(tiny_config(model_type, dropout=0.2)).train()
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = (torch.arange(32).reshape(4, 8) * 7 + 3) % 60 + 4
    with knn.keyed(model, 3, step=1):
        loss = model(input_ids=ids).logits.square().mean()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


# phi: a layer that runs one dropout module twice (resid_dropout), its recompute numbering both calls on
@pytest.mark.parametrize("model_type,class_name", [("bart", "BartForCausalLM"), ("gpt2", "GPT2LMHeadModel"),
                                                  ("phi", "PhiForCausalLM")])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("backward_inside", [True, False])
def test_transformers_gradient_checkpointing_recomputes_the_first_executions_masks(
        model_type, class_name, reentrant, backward_inside):
    """transformers checkpoints a layer's forward, not its call: the recompute runs the layer's own code (BART's
    F.dropout) outside its hooks, and its children on tensors the recompute makes anew (GPT-2's dropouts).
    keyed() wraps the layer's _gradient_checkpointing_func so that the recompute is the layer's execution
    again: the gradients are those without checkpointing."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' deprecation of gradient_checkpointing_enable
        expected = _hf_grads(model_type, class_name, None, True)
        got = _hf_grads(model_type, class_name, reentrant, backward_inside)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-7, msg=name)
