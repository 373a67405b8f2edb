"""A failed ``keyinit.deferred`` leaves what the caller gave it exactly as it was (issue 23): a pretrained
backbone keeps its tensors, their values (also the ones the constructor wrote in place), ``requires_grad``,
submodules, hooks and train/eval mode, whatever the constructor did to it before it failed -- a refusal
of keyinit's or the constructor's own exception, ``KeyboardInterrupt`` included. Stand-ins it cached
(an ``lru_cache`` helper) do not outlive the failure."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from torch import nn

import keyinit
from keyinit.errors import UnkeyedRandomnessError


class Interrupted(BaseException):
    pass


FAILURES = {
    "draw kept in an attribute": (lambda: torch.randn(3), UnkeyedRandomnessError),
    "numpy's global generator": (lambda: np.random.rand(), UnkeyedRandomnessError),
    "Python's global generator": (lambda: random.random(), UnkeyedRandomnessError),
    "the constructor's own error": (lambda: int("x"), ValueError),
    "an interrupt": (lambda: (_ for _ in ()).throw(Interrupted()), Interrupted),
}


class AdaptsBackbone(nn.Module):
    """What fine-tuning wrappers do to a pretrained backbone before building the head."""

    def __init__(self, backbone: nn.Sequential, failure: str) -> None:
        super().__init__()
        self.backbone = backbone
        backbone[0].weight.requires_grad_(False)  # freeze
        with torch.no_grad():
            backbone[0].bias.zero_()  # written in place (for real: it is not a stand-in)
            backbone[1].running_mean.mul_(2)
        backbone[2] = nn.Identity()  # drop its classifier
        backbone.register_forward_hook(lambda module, args, out: out * 2)
        backbone.train()
        backbone.tag = "adapted"
        self.head = nn.Linear(4, 2)
        self.noise = FAILURES[failure][0]()


def _pretrained() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        backbone = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    with torch.no_grad():
        backbone[1].running_mean.fill_(0.5)
    return backbone.eval()


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failed_deferred_leaves_the_backbone_it_was_given_exactly_as_it_was(failure):
    backbone = _pretrained()
    modules = dict(backbone.named_modules())
    tensors = dict(backbone.state_dict(keep_vars=True))
    values = {name: t.detach().clone() for name, t in tensors.items()}
    flags = {name: t.requires_grad for name, t in tensors.items()}
    attributes = set(vars(backbone))
    with pytest.raises(FAILURES[failure][1]):
        keyinit.deferred(AdaptsBackbone, backbone, failure)
    assert dict(backbone.named_modules()) == modules and isinstance(backbone[2], nn.Linear)
    assert dict(backbone.state_dict(keep_vars=True)) == tensors  # the same objects
    for name, tensor in backbone.state_dict(keep_vars=True).items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, values[name]), name
        assert tensor.requires_grad == flags[name], name
    assert not backbone.training and not backbone._forward_hooks and set(vars(backbone)) == attributes


def test_a_deferred_that_succeeds_keeps_what_the_constructor_did_to_the_backbone_as_eager_torch():
    FAILURES["nothing"] = (lambda: None, None)
    try:
        expected = _pretrained()
        model = keyinit.deferred(AdaptsBackbone, _pretrained(), "nothing")
    finally:
        del FAILURES["nothing"]
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.backbone[0].weight, expected[0].weight) and not model.backbone[0].weight.requires_grad
    assert torch.equal(model.backbone[0].bias, torch.zeros(4))
    assert torch.equal(model.backbone[1].running_mean, torch.full((4,), 1.0))
    assert isinstance(model.backbone[2], nn.Identity) and model.backbone.training and model.backbone._forward_hooks


@functools.lru_cache
def _table(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32).cos()


class CachesThenFails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.table = _table(4)
        raise ValueError("the constructor's own bug")


def test_a_stand_in_a_failed_constructor_cached_does_not_reach_later_eager_code():
    _table.cache_clear()
    with pytest.raises(ValueError, match="own bug"):
        keyinit.deferred(CachesThenFails)
    table = _table(4) + 1  # an eager model built later in the same process
    assert type(table) is torch.Tensor and torch.equal(table, torch.arange(4, dtype=torch.float32).cos() + 1)
