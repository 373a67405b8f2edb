"""A property of keyed forwards under activation checkpointing (issue 34): for random small models, checkpointing
changes no mask and no gradient.

Each seed builds a model of residual blocks mixing ``Linear``, ``LayerNorm``, ``GELU``, ``nn.Dropout``,
``F.dropout`` and ``torch.rand_like`` written in the block's own code, and checkpoints some of its blocks:
torch's checkpoint (reentrant or not) of the block, ``keyinit.nn.checkpoint`` (reentrant or not) of the
block or of a function that draws itself around it, or a hand-written reentrant ``autograd.Function`` that
keyinit is not handed (DeepSpeed's kind). ``backward()`` runs inside the keyed block, after it, or after
another keyed block (a teacher). The reference is the same model, same weights, without checkpointing: every
dropout mask the kernels draw (forward, recompute and backward, read at the one kernel seam) is bitwise the
reference's for its key, the keys are the same set, and the gradients are equal (within float tolerance).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import keyinit
import keyinit.nn as knn

WIDTH = 8
CHECKPOINTS = ("torch reentrant", "torch", "keyinit reentrant", "keyinit", "keyinit function", "hand-written")


class HandWritten(torch.autograd.Function):
    """A reentrant checkpoint keyinit does not know: saves the input, reruns the block in backward."""

    @staticmethod
    def forward(ctx, block, x):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.block(x)
        torch.autograd.backward(y, grad)
        return None, x.grad


class Block(nn.Module):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.kinds = [rng.choice(("linear", "norm", "gelu", "dropout", "F.dropout", "rand_like"))
                      for _ in range(rng.randint(2, 5))]
        self.kinds.insert(rng.randrange(len(self.kinds) + 1), "dropout")  # every block draws
        self.ps = [rng.choice((0.1, 0.3, 0.5)) for _ in self.kinds]
        made = {"linear": lambda p: nn.Linear(WIDTH, WIDTH), "norm": lambda p: nn.LayerNorm(WIDTH),
                "gelu": lambda p: nn.GELU(), "dropout": lambda p: nn.Dropout(p)}
        self.layers = nn.ModuleList(made[k](p) if k in made else nn.Identity() for k, p in zip(self.kinds, self.ps))
        self.residual = rng.random() < 0.7

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for kind, p, layer in zip(self.kinds, self.ps, self.layers):
            if kind == "F.dropout":
                h = F.dropout(h, p, self.training)
            elif kind == "rand_like":
                h = h * (1 + p * torch.rand_like(h))
            else:
                h = layer(h)
        return h + x if self.residual else h


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        rng = random.Random(seed)
        self.blocks = nn.ModuleList(Block(rng) for _ in range(rng.randint(1, 4)))
        self.head = nn.Linear(WIDTH, 1)
        self.ways = [rng.choice(("none",) + CHECKPOINTS) for _ in self.blocks]
        self.checkpointing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, way in zip(self.blocks, self.ways):
            function = block
            if way == "keyinit function":  # a function that draws itself, around the block
                function = lambda y, block=block: F.dropout(block(y), 0.2, self.training) * 1.5  # noqa: E731
            reentrant = way.endswith("reentrant")
            if way == "none" or not self.checkpointing:
                x = function(x)
            elif way.startswith("torch"):
                x = torch_checkpoint(function, x, use_reentrant=reentrant)
            elif way.startswith("keyinit"):
                x = knn.checkpoint(function, x, use_reentrant=reentrant)
            else:
                x = HandWritten.apply(function, x)
        return self.head(x)


@contextlib.contextmanager
def _masks() -> Iterator[dict]:
    """Every keyed dropout kernel call while open: ``{(k0, k1, threshold): [(dropped, live), ...]}``."""
    from keyinit._draw import dispatch

    seen: dict = {}
    original = dispatch.dropout

    def recording(x, geometry):
        out = original(x, geometry)
        seen.setdefault((geometry.k0, geometry.k1, geometry.threshold), []).append(
            (((out == 0) & (x != 0)).detach().clone(), (x != 0).detach().clone()))
        return out

    dispatch.dropout = recording
    try:
        yield seen
    finally:
        dispatch.dropout = original


def _run(seed: int, checkpointing: bool, backward: str) -> tuple[list, dict]:
    net = Net(seed)
    keyinit.init_model(net, 0)
    net.train().checkpointing = checkpointing
    teacher = Net(seed + 1000)
    keyinit.init_model(teacher, 1)
    teacher.train().checkpointing = False
    x = torch.linspace(-1, 1, 5 * WIDTH).reshape(5, WIDTH).requires_grad_()
    rng = torch.get_rng_state()
    with _masks() as masks:
        with knn.keyed(net, 11, step=seed):
            loss = net(x).square().sum()
            if backward == "inside":
                loss.backward()
        if backward == "after a teacher block":
            with knn.keyed(teacher, 5, step=seed):
                teacher(torch.ones(5, WIDTH)).sum()
        if backward != "inside":
            loss.backward()
    assert torch.equal(rng, torch.get_rng_state())  # never torch's generator
    assert all(not m._forward_pre_hooks and not m._forward_hooks and "forward" not in vars(m)
               for m in net.modules())  # nothing of keyinit left on the model
    return [x.grad] + [p.grad for p in net.parameters()], masks


BACKWARDS = ("inside", "after", "after a teacher block")


@pytest.mark.parametrize("seed", range(24))
def test_checkpointing_changes_no_mask_and_no_gradient(seed):
    backward = BACKWARDS[seed % len(BACKWARDS)]
    expected_grads, expected = _run(seed, False, backward)
    got_grads, got = _run(seed, True, backward)
    assert got.keys() == expected.keys()
    for key, calls in got.items():
        reference, reference_live = expected[key][0]
        for dropped, live in calls:  # the first execution, the recompute and the backward of each draw
            both = live & reference_live
            assert torch.equal(dropped & both, reference & both), (seed, key)
    assert len(got_grads) == len(expected_grads)
    for a, b in zip(got_grads, expected_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_property_sees_every_kind_of_checkpoint_and_backward():
    """(The seeds above cover each checkpoint, and a model with several of them, so the property is not vacuous.)"""
    ways = [Net(seed).ways for seed in range(24)]
    assert {w for seed_ways in ways for w in seed_ways} == {"none", *CHECKPOINTS}
    assert any(len({w for w in seed_ways if w != "none"}) >= 2 for seed_ways in ways)


def test_a_recompute_with_other_keys_would_be_seen(monkeypatch):
    """The check itself: where torch's checkpoint recomputes a block with another step's keys, it fails."""
    from keyinit.nn._recompute import checkpoint as _checkpoint

    original = _checkpoint.Recompute.__call__

    def shifted(self, *args, **kwargs):
        self.ctx.step += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            self.ctx.step -= 1

    monkeypatch.setattr(_checkpoint.Recompute, "__call__", shifted)
    seed = next(s for s in range(24) if {"torch", "torch reentrant"} & set(Net(s).ways))
    with pytest.raises(AssertionError):
        test_checkpointing_changes_no_mask_and_no_gradient(seed)
