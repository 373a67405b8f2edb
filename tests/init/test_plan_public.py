"""The public plan: ``keyinit.plan_init`` -> ``Plan.values`` / ``Plan.apply`` (issue 15).

``values(fqn, region)`` computes one region of one tensor alone; it must be exactly what
``apply`` writes there, which is exactly what ``init_model``/``materialize`` write.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import keyinit
from keyinit import init
from tests.conftest import assert_bits_equal


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, padding_idx=0)
        self.proj = nn.Linear(8, 12)
        self.head = nn.Linear(12, 50, bias=False)
        self.register_buffer("steps", torch.zeros(()))
        self.apply(self._init)

    def _init(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def test_values_of_any_region_are_what_apply_writes():
    plan = keyinit.plan_init(keyinit.deferred(Net), 5)
    assert plan.fqns == ("steps", "emb.weight", "proj.weight", "proj.bias", "head.weight")  # model order
    rows = plan.values("head.weight", (slice(10, 20), slice(None)))
    picked = plan.values("emb.weight", (torch.tensor([0, 7, 49]), slice(2, 6)))
    whole = {fqn: plan.values(fqn) for fqn in plan.fqns}
    model = plan.model
    assert all(t.is_meta for t in model.parameters())  # planning and values allocate nothing in the model
    report = plan.apply(device="cpu")
    assert report.defaults == ()  # every tensor from its constructor (nn.Embedding's own reset_parameters too)
    for fqn, values in whole.items():
        assert_bits_equal(model.get_parameter(fqn) if "." in fqn else model.get_buffer(fqn), values)
    assert_bits_equal(rows, model.head.weight[10:20])
    assert_bits_equal(picked, model.emb.weight[[0, 7, 49], 2:6])


def test_init_model_and_materialize_are_plan_then_apply():
    a, b = Net(), Net()
    keyinit.init_model(a, 3, rules={"proj.bias": init.constant(0.5)})
    keyinit.plan_init(b, 3, rules={"proj.bias": init.constant(0.5)}).apply()
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert_bits_equal(x, y)
    c, d = keyinit.deferred(Net), keyinit.deferred(Net)
    keyinit.materialize(c, 3, device="cpu")
    keyinit.plan_init(d, 3).apply(device="cpu")
    for x, y in zip(c.state_dict().values(), d.state_dict().values()):
        assert_bits_equal(x, y)


def test_entries_describe_every_tensor_kept_ones_included():
    model = Net()
    plan = keyinit.plan_init(model, 0)
    entries = {e.fqn: e for e in plan.entries}
    assert entries["steps"].origin == "kept" and "steps" not in plan.fqns
    assert entries["proj.weight"].origin == "default" and entries["proj.weight"].source == "default Linear"
    assert entries["head.weight"].locations == ((model.head, "weight"),)
    assert plan.entry("proj.bias").global_shape == (12,)


def test_bad_names_regions_and_second_apply_are_clear_errors():
    plan = keyinit.plan_init(Net(), 0)
    with pytest.raises(KeyError, match="'proj.wieght' is not a tensor of this plan"):
        plan.values("proj.wieght")
    with pytest.raises(KeyError, match="keeps this tensor"):
        plan.values("steps")
    with pytest.raises(ValueError, match=r"proj.weight: bad region"):
        plan.values("proj.weight", (slice(None),))
    with pytest.raises(ValueError, match="device= is for a meta-device model"):
        plan.apply(device="cpu")
    plan = keyinit.plan_init(Net(), 0)
    plan.apply()
    with pytest.raises(RuntimeError, match="already applied"):
        plan.apply()


def test_plan_errors_come_before_anything_is_allocated():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    model.register_parameter("free", nn.Parameter(torch.empty(3, device="meta")))
    with pytest.raises(keyinit.PlanError) as err:
        keyinit.plan_init(model, 0)
    assert err.value.fqns == ("free",)
    assert all(t.is_meta for t in model.parameters())


def test_a_tensor_of_no_elements_needs_no_init():
    # HF's DINOv3 with num_register_tokens=0: torch.empty(1, 0, dim) that no init code touches
    class Registers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Parameter(torch.empty(1, 0, 4))
            self.proj = nn.Linear(4, 4)

    with torch.device("meta"):
        model = Registers()
    report = keyinit.materialize(model, 0, device="cpu")
    assert model.tokens.shape == (1, 0, 4) and not model.tokens.is_meta
    assert {r.fqn: r.source for r in report.records}["tokens"] == "kept"
    with torch.device("meta"):
        model = Registers()
    model.tokens = nn.Parameter(torch.empty(1, 2, 4, device="meta"))  # with elements it must be covered
    with pytest.raises(keyinit.PlanError, match="tokens"):
        keyinit.materialize(model, 0, device="cpu")
