"""A deferred ModuleList changed after construction (issue 23): each tensor is keyed by the name it was
built with, so a stage gets the full model's values for the layers it holds -- also for a layer placed at
two indices -- and two different tensors are never keyed alike (a clear PlanError instead)."""

from __future__ import annotations

import pytest
import torch

import keyinit
from tests.deferred.test_hostile_constructors import DepthBlock, Stack  # the renumbered-stack models


@pytest.fixture(scope="module")
def full() -> Stack:
    model = keyinit.deferred(Stack)
    keyinit.materialize(model, seed=0, device="cpu")
    return model


def test_a_layer_placed_at_two_indices_gets_the_values_it_was_built_with(full):
    stage = keyinit.deferred(Stack)
    stage.layers.insert(1, stage.layers[3])  # the same block at indices 1 and 4; 1..3 move to 2..4
    keyinit.materialize(stage, seed=0, device="cpu")
    assert stage.layers[1] is stage.layers[4]
    for index, built in ((0, 0), (1, 3), (2, 1), (3, 2), (4, 3)):
        assert torch.equal(stage.layers[index].fc.weight, full.layers[built].fc.weight), index
        assert torch.equal(stage.layers[index].fc.bias, full.layers[built].fc.bias), index


def test_a_renumbered_layer_and_a_new_one_keyed_by_the_same_name_are_a_plan_error_naming_both():
    stage = keyinit.deferred(Stack)
    del stage.layers[0]  # layers.1..3 now sit at 0..2 and are keyed as built
    stage.layers.append(keyinit.deferred(DepthBlock, 9))  # built alone: keyed by where it sits, layers.3
    clash = (r"layers\.2\.fc\.weight \(renumbered\) and layers\.3\.fc\.weight would all be keyed as "
             r"layers\.3\.fc\.weight")
    with pytest.raises(keyinit.PlanError, match=clash + ".*same random values") as error:
        keyinit.materialize(stage, seed=0, device="cpu")
    assert {"layers.2.fc.weight", "layers.3.fc.weight"} <= set(error.value.fqns)
    assert all(p.is_meta for p in stage.parameters())  # nothing allocated or written


def test_with_fqn_map_naming_each_tensor_the_new_layer_gets_its_own_values(full):
    stage = keyinit.deferred(Stack)
    del stage.layers[0]
    stage.layers.append(keyinit.deferred(DepthBlock, 9))
    names = {f"layers.{i}.fc.{p}": f"layers.{i + 1}.fc.{p}" for i in range(4) for p in ("weight", "bias")}
    keyinit.materialize(stage, seed=0, device="cpu", fqn_map=names)
    for i in range(3):
        assert torch.equal(stage.layers[i].fc.weight, full.layers[i + 1].fc.weight), i
    assert not torch.equal(stage.layers[3].fc.bias, stage.layers[2].fc.bias)
