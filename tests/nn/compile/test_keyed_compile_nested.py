"""Compiled blocks nested in a compiled model (``keyinit.nn.compile`` on a block and on its parent): dynamo
traces the inner block as part of the outer forward, keyed by the outer trace, with the eager keyed values."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import keyinit.nn as knn


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(nn.Module):
    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.lin, self.drop, self.graph_break = nn.Linear(8, 8), nn.Dropout(0.3), graph_break

    def forward(self, x):
        y = torch.relu(self.lin(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.drop(y) + (torch.rand_like(y) * 0.01 if self.training else 0)


class Net(nn.Module):
    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.out = Block(graph_break), Block(), nn.Dropout(0.2)

    def forward(self, x):
        return self.out(self.b(self.a(x)) + self.a(x))  # (block a called twice: its calls numbered on)


def _pair(graph_break: bool = False) -> tuple[Net, knn.KeyedCompiled]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        eager = Net(graph_break).train()
    net = Net(graph_break).train()
    net.load_state_dict(eager.state_dict())
    net.a = knn.compile(net.a, backend="aot_eager")
    net.b = knn.compile(net.b, backend="aot_eager")
    return eager, knn.compile(net, backend="aot_eager")


def _check(eager: Net, model: knn.KeyedCompiled, x: torch.Tensor, step: int, offset: int) -> None:
    with knn.keyed(eager, 0, step=step, sample_offset=offset):
        want = eager(x)
    with knn.keyed(model, 0, step=step, sample_offset=offset):
        got = model(x)
    assert torch.equal(got == 0, want == 0), (step, offset)  # the outer dropout's mask, bit for bit
    torch.testing.assert_close(got, want)


def test_compiled_blocks_in_a_compiled_model_equal_eager_keyed():
    eager, model = _pair()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compiled, not run eagerly after a fallback
        for step, offset in [(0, 0), (1, 4), (2, 0)]:
            _check(eager, model, x, step, offset)
    assert not model.runs_eagerly
    # the inner blocks hold no graphs of their own: the outer trace keys their draws
    assert model.cached_traces >= 1 and model.module.a.cached_traces == 0
    x.grad = None
    with knn.keyed(model, 0, step=3):
        model(x.requires_grad_()).sum().backward()
    assert x.grad is not None
    model.eval()
    eager.eval()
    torch.testing.assert_close(model(x), eager(x))  # outside keyed, in eval mode: runs compiled


def test_a_graph_break_in_a_nested_block_runs_the_model_as_an_eager_keyed_forward():
    eager, model = _pair(graph_break=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*runs part of its forward eagerly")
        for step, offset in [(0, 0), (1, 4)]:
            _check(eager, model, x, step, offset)
