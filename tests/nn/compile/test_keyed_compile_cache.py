"""A compiled keyed model's trace cache stays bounded over a long run: steps, sample offsets and routings
(compiled MoE experts fed the rows a router picked by values) add no entries, and memory does not grow,
while every mask equals the eager keyed forward's."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import keyinit.nn as knn

B, L, D, EXPERTS = 2, 3, 4, 2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="keyinit.nn.compile.*runs eagerly")
        yield
    torch._dynamo.reset()


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(D, D), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


class MoE(nn.Module):
    """A top-1 router picking each token's expert by the values of its logits (``topk``); each expert gets
    its rows ``x[idx]``, written back by ``index_add``. ``outs``: ``{expert: (rows, output)}``, last forward."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.outs: dict = {}

    def forward(self, h):
        x = h.reshape(-1, D)
        choice = self.router(x).topk(1, dim=-1).indices[:, 0]
        out = torch.zeros_like(x)
        self.outs = {}
        for i, expert in enumerate(self.experts):
            idx = torch.where(choice == i)[0]
            if idx.numel() == 0:
                continue
            y = expert(x[idx])
            self.outs[i] = (idx, y.detach())
            out = out.index_add(0, idx, y)
        return out.view(h.shape)


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_routed_experts_keep_a_bounded_cache_over_200_steps():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        eager = MoE().train()
    model = MoE().train()
    model.load_state_dict(eager.state_dict())
    for i, expert in enumerate(model.experts):
        model.experts[i] = knn.compile(expert, backend="aot_eager")
    compiled = list(model.experts)
    sizes, rss = [], []
    for step in range(200):
        h = torch.randn(B, L, D, generator=torch.Generator().manual_seed(step))  # a new routing each step
        offset = (7 * step) % 11
        with knn.keyed(model, 0, step=step, sample_offset=offset):
            out = model(h)
        if step % 10 == 0:  # the eager keyed forward's masks, bit for bit (values: torch's kernels, a tolerance)
            with knn.keyed(eager, 0, step=step, sample_offset=offset):
                want = eager(h)
            torch.testing.assert_close(out, want)
            assert model.outs.keys() == eager.outs.keys(), step
            for i, (rows, y) in model.outs.items():
                assert torch.equal(rows, eager.outs[i][0]), (step, i)
                assert torch.equal(y == 0, eager.outs[i][1] == 0), (step, i)
                torch.testing.assert_close(y, eager.outs[i][1])
        sizes.append(sum(c.cached_traces for c in compiled))
        if step >= 49:
            rss.append(_resident_mb())
    # a few dynamo graphs per expert (one row, the first count, any count), each with one entry for routed
    # rows and one per batch size for the rare step that sends every row to one expert (then a batch)
    assert max(sizes) <= 4 * EXPERTS, sizes[::10]
    assert rss[-1] - rss[0] < 4.0, (rss[0], rss[-1])  # MB over the last 150 steps


def test_a_graph_keeps_at_most_cache_size_traces(monkeypatch):
    """Batch sizes beyond the bound: the least recently used trace goes, and a size that comes back is
    traced again, with the eager keyed forward's values."""
    import keyinit.nn._compiled.compile as compile_module

    monkeypatch.setattr(compile_module, "CACHE_SIZE", 3)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        eager = Expert().train()
    compiled = knn.compile(eager, backend="aot_eager")  # (a static graph, then one with a dynamic batch)
    for step, rows in enumerate([2, 3, 4, 5, 6, 2, 7, 3]):
        x = torch.randn(rows, D, generator=torch.Generator().manual_seed(step))
        with knn.keyed(compiled, 0, step=step):
            out = compiled(x)
        with knn.keyed(eager, 0, step=step):
            want = eager(x)
        assert torch.equal(out == 0, want == 0), step
        torch.testing.assert_close(out, want)
        assert all(len(graph.entries) <= 3 for graph in compiled._graphs)
    assert max(len(graph.entries) for graph in compiled._graphs) == 3
