"""Hostile and careless input, round 5 (issue 34): the smaller cases, each a clear error or the right values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import keyinit


# ---------------------------------------------------------------- 1. Plan.values with int region entries


def test_plan_values_int_entries_index_like_the_whole_tensor():
    with torch.device("meta"):
        model = nn.Linear(4, 5)
    plan = keyinit.plan_init(model, 0)
    full = plan.values("weight")
    assert torch.equal(plan.values("weight", (3, slice(None))), full[3, :])
    assert torch.equal(plan.values("weight", (slice(1, 4), -1)), full[1:4, -1])
    assert torch.equal(plan.values("weight", (np.int64(2), torch.tensor(1))), full[2, 1])
    assert plan.values("weight", (-5, 0)).shape == ()
    assert torch.equal(plan.values("weight", ([3], slice(None))), full[[3], :])  # a list keeps the dimension
    with pytest.raises(ValueError, match=r"weight: bad region .*region entry 0 has index 5, out of bounds for size 5"):
        plan.values("weight", (5, slice(None)))
    with pytest.raises(ValueError, match=r"weight: bad region .*region entry 0 must be .* got bool"):
        plan.values("weight", (True, slice(None)))


# ---------------------------------------------------------------- 2. a deferred model cast to float8


class _PartlyWritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.zero = nn.Parameter(torch.zeros(3))
        self.halves = nn.Parameter(torch.empty(6, 2))
        nn.init.normal_(self.halves[:3], std=0.5)  # written in pieces: replayed element by element
        nn.init.ones_(self.halves[3:])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float64])
def test_a_deferred_model_cast_after_construction_is_the_built_model_rounded(dtype):
    reference = keyinit.deferred(_PartlyWritten)
    keyinit.materialize(reference, 0)
    model = keyinit.deferred(_PartlyWritten).to(dtype)
    keyinit.materialize(model, 0)
    expected = dict(reference.named_parameters())
    for name, tensor in model.named_parameters():
        assert tensor.dtype == dtype
        assert torch.equal(tensor.view(torch.uint8) if dtype.itemsize == 1 else tensor,
                           expected[name].detach().to(dtype).view(torch.uint8) if dtype.itemsize == 1
                           else expected[name].detach().to(dtype)), name


# ---------------------------------------------------------------- 3. an un-run lazy module


def _with_lazy() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.LazyLinear(2))


def test_an_unrun_lazy_module_is_refused_naming_it():
    lazy = r"lazy module 1 \(LazyLinear: weight, bias\) not initialized yet: .* Run a forward on a sample input first"
    with pytest.raises(keyinit.PlanError, match=r"keyinit.deferred\(.*_with_lazy\): " + lazy):
        keyinit.deferred(_with_lazy)
    model = _with_lazy()
    with pytest.raises(keyinit.PlanError, match="cannot plan the model: " + lazy):
        keyinit.init_model(model, 0)
    with pytest.raises(keyinit.PlanError, match="cannot plan the model: " + lazy) as raised:
        keyinit.plan_init(model, 0)
    assert raised.value.fqns == ("1.weight", "1.bias")
    model(torch.zeros(1, 3))  # the forward gives it its shape: then it initializes as an nn.Linear
    keyinit.init_model(model, 0)
    assert torch.equal(model[1].weight, keyinit.plan_init(model, 0).values("1.weight"))


# ---------------------------------------------------------------- 4. keyed_samples needs indexed samples


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from (torch.rand(2) for _ in range(3))


def test_keyed_samples_refuses_an_iterable_dataset():
    import keyinit.data

    with pytest.raises(TypeError, match=r"keyed_samples: dataset must be map-style .* got _Stream, an IterableDataset"):
        keyinit.data.keyed_samples(_Stream(), 0)
    with pytest.raises(TypeError, match=r"keyed_samples: dataset must be map-style .* got generator, not indexable"):
        keyinit.data.keyed_samples((x for x in range(3)), 0)
    samples = keyinit.data.keyed_samples([torch.zeros(1)], 0, epoch=0)  # a list is map-style
    assert torch.equal(samples[0], torch.zeros(1))


# ---------------------------------------------------------------- 5. permutation under torch.device("meta")


def test_permutation_under_a_meta_default_device_is_a_clear_error_or_real_values():
    import keyinit.data

    k = keyinit.key(0)
    whole, inverse = keyinit.data.permutation(k, 10), keyinit.data.inverse_permutation(k, 10)
    meta = r"keyinit.data.%s: the result would be on the meta device \(%s\), which holds no values; pass device='cpu'"
    with torch.device("meta"):
        default = r"the default device, inside `with torch.device\('meta'\)`"
        with pytest.raises(ValueError, match=meta % ("permutation", default)):
            keyinit.data.permutation(k, 10)
        with pytest.raises(ValueError, match=meta % ("inverse_permutation", default)):
            keyinit.data.inverse_permutation(k, 10, range(3))
        with pytest.raises(ValueError, match=meta % ("permutation", "device='meta' was asked for")):
            keyinit.data.permutation(k, 10, device="meta")
        with pytest.raises(ValueError, match=meta % ("permutation", "the positions tensor is on it")):
            keyinit.data.permutation(k, 10, torch.tensor([1, 2]))  # made on meta
        # a real device asked for, or real positions: the values, the kernels' temporaries kept off meta (SIGSEGV)
        assert torch.equal(keyinit.data.permutation(k, 10, device="cpu"), whole)
        assert torch.equal(keyinit.data.permutation(k, 10, [3, 1], device="cpu"), whole[[3, 1]])
        positions = torch.tensor([4, 0, 9], device="cpu")
        assert torch.equal(keyinit.data.permutation(k, 10, positions), whole[positions])
        assert torch.equal(keyinit.data.inverse_permutation(k, 10, positions), inverse[positions])


# ---------------------------------------------------------------- 6. keyinit demo --timeout


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon"])
def test_demo_timeout_must_be_a_positive_number_of_seconds(value, capsys):
    from keyinit.cli import main

    with pytest.raises(SystemExit) as exited:  # argparse's usage error, before any rank is spawned
        main(["demo", "--timeout", value])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (f"keyinit demo: error: argument --timeout: expected a positive number of "
                                       f"seconds, got {value!r} (see keyinit demo --help)\n")
