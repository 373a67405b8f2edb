"""Different parameters a deferred constructor builds as views sharing elements of one buffer (issue 23:
``a = Parameter(base)``, ``b = Parameter(base[:2])``): the record keeps what each held, so every layout
gets eager torch's values (b's zeros in a's rows too), and the report says each now has its own memory.
An allocated model with such tensors is a PlanError (tests/deferred/test_hostile_constructors.py)."""

from __future__ import annotations

import torch
from torch import nn

import keyinit
from keyinit.layouts import ManualShard


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        base = torch.empty(8, 4)
        nn.init.normal_(base)
        self.a = nn.Parameter(base)
        self.b = nn.Parameter(base[:2])
        with torch.no_grad():
            self.b.mul_(0.0).add_(3.0)  # eager torch: these land in a's first rows too


def test_views_sharing_a_buffer_get_eager_torchs_values_on_every_layout_and_a_note():
    model = keyinit.deferred(Shared)
    report = keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.b, torch.full((2, 4), 3.0)) and torch.equal(model.a[:2], model.b)
    assert bool((model.a[2:] != 3.0).all())
    assert any("a and b shared memory when the constructor built them" in note for note in report.notes)
    rows = keyinit.deferred(Shared)
    rows.a = nn.Parameter(torch.empty(3, 4, device="meta"))  # rows 1..3 of a, as a rank would hold them
    keyinit.materialize(rows, 0, device="cpu", shards={"a": ManualShard((8, 4), (slice(1, 4), slice(None)))})
    assert torch.equal(rows.a, model.a[1:4])
