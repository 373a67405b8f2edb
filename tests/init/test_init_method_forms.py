"""Which form an ``init_method`` callable has is decided by what it accepts, or said explicitly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import keyinit


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.calls = []

    def init_weights(self, *args, **kwargs):  # torchtitan / OLMo-core style: called once, with kwargs
        self.calls.append(kwargs)
        nn.init.zeros_(self.a.weight)
        nn.init.zeros_(self.b.weight)


def _meta_net():
    with torch.device("meta"):
        return Net()


def test_var_args_method_is_called_once_with_the_init_kwargs():
    model = _meta_net()
    report = keyinit.materialize(model, 0, device="cpu", init_method="init_weights", init_kwargs={"max_seq_len": 8})
    assert model.calls == [{"max_seq_len": 8}]
    assert report.by_source()["init_weights"] == ["a.weight", "b.weight"]


def test_explicit_forms():
    seen = []

    def visit(*args):
        seen.append(type(args[0]).__name__ if args else None)

    keyinit.materialize(_meta_net(), 0, device="cpu", init_method=keyinit.per_module(visit))
    assert seen == ["Linear", "Linear", "Net"]  # children first
    seen.clear()
    keyinit.materialize(_meta_net(), 0, device="cpu", init_method=keyinit.call_once(visit))
    assert seen == [None]


def test_explicit_form_needs_a_callable():
    with pytest.raises(TypeError, match="callable"):
        keyinit.per_module("init_weights")
