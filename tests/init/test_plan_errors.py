"""Errors a plan can see are PlanErrors before any write; materialize is atomic for any BaseException."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import keyinit
from keyinit import init
from keyinit.layouts import ManualShard
from tests._support.nets import TwoLinears


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unchanged(before: dict[str, torch.Tensor], model: nn.Module) -> bool:
    return all(torch.equal(before[k], v) for k, v in model.state_dict().items())


CASES = [
    ("'*' rule hitting an int buffer", lambda: nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)),
     {"rules": {"*": init.normal()}}, r"1\.num_batches_tracked: normal draws floating-point values .* torch\.int64",
     ("1.num_batches_tracked",)),
    ("unmeetable bf16 trunc bounds", lambda: nn.Linear(4, 4).to(torch.bfloat16),
     {"rules": {"weight": init.truncated_normal(a=1.001, b=1.002)}}, r"weight: truncated_normal: no torch\.bfloat16 value",
     ("weight",)),
    ("eye on a 1-D tensor", lambda: nn.Linear(2, 2), {"rules": {"bias": init.eye()}},
     r"bias: eye needs a 2-D tensor, got global shape \(2,\)", ("bias",)),
    ("an out-of-range zero row", lambda: nn.Embedding(4, 2), {"rules": {"weight": init.with_zero_rows(init.normal(), 7)}},
     r"weight: row 7 is out of range for global shape \(4, 2\)", ("weight",)),
    ("a non-callable FQN rule", lambda: nn.Linear(2, 2), {"rules": {"weight": 3}},
     r"the rule for FQN pattern 'weight' is not callable: 3", ()),
    ("a non-callable module rule", lambda: nn.Linear(2, 2), {"rules": {nn.Linear: "xavier"}},
     r"the rule for Linear is not callable: 'xavier'", ()),
    ("a shards= shape mismatch", lambda: nn.Linear(2, 2),
     {"shards": {"weight": ManualShard((4, 2), (slice(0, 1), slice(None)))}},
     r"^weight: the declared region \[0, :\] of global shape \(4, 2\) has shape \(1, 2\), but the local tensor has shape \(2, 2\)$",
     ("weight",)),
]


@pytest.mark.parametrize("factory,kwargs,message,fqns", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan_visible_errors_are_plan_errors_before_any_write(factory, kwargs, message, fqns):
    model = factory()
    before = snapshot(model)
    with pytest.raises(keyinit.PlanError, match=message) as info:
        keyinit.init_model(model, 0, **kwargs)
    assert info.value.fqns == fqns
    assert unchanged(before, model)
    with torch.device("meta"):
        meta = factory()
    if "shards" not in kwargs:
        with pytest.raises(keyinit.PlanError, match=message):
            keyinit.materialize(meta, 0, device="cpu", **kwargs)
        assert all(t.is_meta for t in meta.state_dict().values())


def test_unkeyed_randomness_error_is_not_wrapped():
    class Gamma(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.w.copy_(torch._standard_gamma(torch.ones(3)))

    with torch.device("meta"):
        model = Gamma()
    try:
        keyinit.materialize(model, 0, device="cpu")
    except keyinit.UnkeyedRandomnessError as exc:
        assert "Gamma at <root>" in str(exc) and "_standard_gamma" in str(exc)
        assert not isinstance(exc, keyinit.InitError)
    else:
        raise AssertionError("expected UnkeyedRandomnessError")
    assert model.w.is_meta


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, torch.OutOfMemoryError])
def test_materialize_returns_to_meta_on_any_base_exception_while_writing(error):
    def explode(key, target):
        raise error("stop")

    with torch.device("meta"):
        model = TwoLinears()
    expected = keyinit.InitError if issubclass(error, Exception) else error
    with pytest.raises(expected):
        keyinit.materialize(model, 0, device="cpu", rules={"b.weight": explode})
    assert all(t.is_meta for t in model.state_dict().values())


def test_materialize_returns_to_meta_when_allocation_fails():
    class OOMOnAllocate(nn.Module):
        """Allocation of its tensors fails half-way, as an OOM inside ``to_empty`` does."""

        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)

        def _apply(self, fn, recurse=True):
            if any(t.is_meta for t in self.parameters()) and fn(torch.empty(1, device="meta")).device.type != "meta":
                self.a._apply(fn)
                raise torch.OutOfMemoryError("CPU out of memory (simulated)")
            return super()._apply(fn, recurse)

    with torch.device("meta"):
        model = OOMOnAllocate()
    with pytest.raises(keyinit.InitError, match="simulated.*returned to the meta device"):
        keyinit.materialize(model, 0, device="cpu")
    assert all(t.is_meta for t in model.state_dict().values())


def test_written_is_exact_and_includes_deterministic_writes():
    calls = []

    def second_fails(key, target):
        calls.append(target.fqn)
        if len(calls) == 2:
            raise RuntimeError("boom")
        target.out.fill_(1.0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(3)  # defaults: ones/zeros (deterministic, written first)
            self.x = nn.Parameter(torch.zeros(2))
            self.y = nn.Parameter(torch.zeros(2))

    model = Model()
    with pytest.raises(keyinit.InitError) as info:
        keyinit.init_model(model, 0, rules={"x": second_fails, "y": second_fails})
    assert set(info.value.written) == {"norm.weight", "norm.bias", "x"}
    assert torch.equal(model.x, torch.ones(2)) and torch.equal(model.y, torch.zeros(2))
