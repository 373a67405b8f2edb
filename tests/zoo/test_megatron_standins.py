"""megatron-core's layout attributes on small stand-in modules (no megatron-core needed).

The stand-ins carry the attributes megatron-core 0.16 layers and experts modules keep
(``tp_group``, ``output_size``/``output_size_per_partition``, ``ep_group``,
``num_local_experts``, ``local_experts``, ``local_expert_indices``) and groups with
``rank()``/``size()``. megatron reads a group only once torch.distributed is initialized, so
each check runs in one real gloo rank (``tests/_support/dist.py``).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import keyinit
from keyinit import init
from keyinit.layouts import MegatronLayout, register_layout, target_for, unregister_layout
from tests._support.dist import requires_gloo, run_distributed

pytestmark = requires_gloo

RULES = {"*": init.normal(std=0.02)}


class Group:
    """A process group as megatron's layers read it: ``rank()`` and ``size()``."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def column(rank: int, size: int, out: int = 8, group: bool = True) -> nn.Module:
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.empty(out // size, 3))
    layer.weight.tensor_model_parallel, layer.weight.partition_dim, layer.weight.partition_stride = True, 0, 1
    layer.output_size, layer.output_size_per_partition = out, out // size
    if group:
        layer.tp_group = Group(rank, size)
    return layer


def experts(ep_rank: int, ep_size: int, local: int, cls_name: str = "SequentialMLP") -> nn.Module:
    module = type(cls_name, (nn.Module,), {})()
    module.ep_group = Group(ep_rank, ep_size)
    module.num_local_experts = local
    module.local_experts = nn.ModuleList(nn.Linear(3, 2, bias=False) for _ in range(local))
    return module


def _layer_group_decides() -> None:
    full = column(0, 1)
    keyinit.init_model(full, 5, rules=RULES)
    for rank in range(2):
        shard = column(rank, 2)
        target = target_for(shard.weight, fqn="weight", module=shard, name="weight")
        assert target.description == f"megatron TP[{rank}/2] dim 0"
        keyinit.init_model(shard, 5, rules=RULES)
        assert torch.equal(shard.weight, full.weight[4 * rank:4 * rank + 4])
    layout = register_layout(MegatronLayout(1, 4))  # contradicts the layer's group
    try:
        with pytest.raises(keyinit.PlanError, match=re.escape(
                "weight: the registered MegatronLayout(tp_rank=1, tp_size=4) contradicts its layer's own "
                "tp_group (rank 0 of 2)")):
            keyinit.init_model(column(0, 2), 5, rules=RULES)
    finally:
        unregister_layout(layout)


def _sizes_contradict() -> None:
    layer = column(0, 2, group=False)  # an older layer: no tp_group; 4 of output_size 8 here
    layout = register_layout(MegatronLayout(0, 4))
    try:
        with pytest.raises(keyinit.PlanError, match=r"weight: read as split over 4 tensor-parallel ranks .* but "
                                                    r"its layer \(Module\) has output_size=8 and "
                                                    r"output_size_per_partition=4"):
            keyinit.init_model(layer, 5, rules=RULES)
    finally:
        unregister_layout(layout)


def _experts_global_names() -> None:
    whole = nn.Module()
    whole.experts = experts(0, 1, 4)
    keyinit.init_model(whole, 5, rules=RULES)
    for ep_rank in range(2):
        model = nn.Module()
        model.experts = experts(ep_rank, 2, 2)
        report = keyinit.init_model(model, 5, rules=RULES)
        assert [r.key_fqn for r in report.records] == [
            f"experts.local_experts.{2 * ep_rank + i}.weight" for i in range(2)]
        for i in range(2):
            assert torch.equal(model.experts.local_experts[i].weight,
                               whole.experts.local_experts[2 * ep_rank + i].weight)


def _experts_contradict() -> None:
    model = nn.Module()
    model.experts = experts(1, 2, 2)
    model.experts.local_expert_indices = [0, 1]
    with pytest.raises(ValueError, match=re.escape(
            "experts: local_expert_indices [0, 1] contradict expert-parallel rank 1 of 2 with 2 local experts "
            "(global experts [2, 3])")):
        keyinit.init_model(model, 5, rules=RULES)
    model.experts.local_expert_indices = [2, 3]
    keyinit.init_model(model, 5, rules=RULES)
    model.experts.num_local_experts = 3
    with pytest.raises(ValueError, match=r"experts: num_local_experts is 3 but local_experts holds 2 experts"):
        keyinit.init_model(model, 5, rules=RULES)
    model.experts = experts(-1, 2, 2)
    with pytest.raises(ValueError, match=r"experts: its ep_group: this process is not a member \(rank -1"):
        keyinit.init_model(model, 5, rules=RULES)


def _packed_experts_refused() -> None:
    model = nn.Module()
    model.experts = type("GroupedMLP", (nn.Module,), {})()
    model.experts.ep_group, model.experts.num_local_experts = Group(0, 2), 2
    model.experts.weight1 = nn.Parameter(torch.empty(3, 4))
    with pytest.raises(ValueError, match=r"experts: GroupedMLP packs its 2 local experts into one tensor"):
        keyinit.init_model(model, 5, rules=RULES)
    model.experts.ep_group = Group(0, 1)  # no expert parallelism: the tensor is whole
    keyinit.init_model(model, 5, rules=RULES)
    te_grouped = type("TEGroupedMLP", (nn.Module,), {})
    model.experts = type("InferenceGroupedMLP", (te_grouped,), {})()  # a subclass (megatron 0.19) is refused too
    model.experts.ep_group, model.experts.num_local_experts = Group(1, 2), 2
    model.experts.weight1 = nn.Parameter(torch.empty(3, 4))
    with pytest.raises(ValueError, match=r"experts: InferenceGroupedMLP packs its 2 local experts"):
        keyinit.init_model(model, 5, rules=RULES)
    model.experts.ep_group = Group(0, 1)
    model.experts.tp_group = Group(1, 2)  # split over expert tensor parallelism: refused as well
    model.experts.weight1.tensor_model_parallel, model.experts.weight1.partition_dim = True, 1
    with pytest.raises(keyinit.PlanError, match=r"experts.weight1: InferenceGroupedMLP packs all local experts "
                                                r"into one tensor split over 2 expert tensor-parallel ranks"):
        keyinit.init_model(model, 5, rules=RULES)


@pytest.mark.parametrize("check", [_layer_group_decides, _sizes_contradict, _experts_global_names,
                                   _experts_contradict, _packed_experts_refused])
def test_megatron_standins(check):
    run_distributed(check, 1)


def test_without_torch_distributed_a_layer_group_is_a_group_of_one():
    """megatron's get_pg_size/get_pg_rank: before init_process_group every group is (rank 0, size 1), so a
    layer that says it holds half of its output is an error, not a whole tensor."""
    layer = column(0, 1, out=4)
    target = target_for(layer.weight, fqn="weight", module=layer, name="weight")
    assert target.global_shape == (4, 3) and target.description == "megatron TP[0/1] dim 0"
    with pytest.raises(ValueError, match=r"weight: read as split over 1 tensor-parallel ranks \(dim 0, 2 here\), "
                                         r"its global size would be 2, but its layer \(Module\) has output_size=4"):
        half = column(1, 2, out=4)
        target_for(half.weight, fqn="weight", module=half, name="weight")
