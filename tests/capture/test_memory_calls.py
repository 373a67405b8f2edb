"""Memory-management calls inside captured init code act on the stand-ins.

OLMo-core's and torchtitan's ``init_weights`` start with ``self.to_empty(device=...)``, and init
code may move a model with ``.to(device)``/``.cpu()``. keyinit runs that code on global stand-ins
that hold no memory: ``Module._apply`` (which all of these call) moves nothing, and ``to_empty``
leaves the elements uninitialized as eager torch does, so the code must write them again. On an
FSDP2 model, FSDP's own ``_apply`` (which re-pads its shards in ``reset_sharded_param``) and
``unshard``/``reshard`` never see a stand-in: capture works as on one process, with 0 collectives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import keyinit
from tests._support.dist import requires_gloo, run_distributed

SEED = 5


class Net(nn.Module):
    """Init code that manages its own memory, as OLMo-core's does (``calls`` says which calls)."""

    def __init__(self, calls: tuple[str, ...] = ("to_empty", "to", "cpu")) -> None:
        super().__init__()
        self.calls = calls
        self.lin = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("pos", torch.empty(16), persistent=False)

    def init_weights(self, device: Any = None) -> None:
        device = torch.device(device or "cpu")
        if "to_empty" in self.calls:
            self.to_empty(device=device)
        if "to" in self.calls:
            self.to(device)
        if "cpu" in self.calls:
            self.lin.cpu()
        if "half" in self.calls:
            self.half()
        if "gather" in self.calls and hasattr(self, "unshard"):  # FSDP2's own calls
            self.unshard()
            self.reshard()
        if "read" in self.calls:
            self.norm.weight.mul_(2.0)  # after to_empty: uninitialized memory
            self.norm.bias.zero_()
        nn.init.normal_(self.lin.weight, std=0.5)
        nn.init.zeros_(self.lin.bias)
        if "skip_norm" not in self.calls:
            self.norm.reset_parameters()
        self.pos.copy_(torch.arange(16.0))


def _materialize(model: nn.Module) -> keyinit.InitReport:
    return keyinit.materialize(model, SEED, device="cpu", init_method="init_weights", init_kwargs={"device": "cpu"})


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name] = full.detach().clone()
    return out


def _meta(calls: tuple[str, ...] = ("to_empty", "to", "cpu")) -> Net:
    with torch.device("meta"):
        return Net(calls)


def test_to_empty_and_moves_change_nothing_keyed():
    """The same values, bit for bit, as the same init code without the memory calls."""
    with_calls, without = _meta(), _meta(())
    report = _materialize(with_calls)
    _materialize(without)
    mine, plain = _state(with_calls), _state(without)
    assert set(mine) == {"lin.weight", "lin.bias", "norm.weight", "norm.bias", "pos"}
    assert all(torch.equal(mine[k], plain[k]) for k in plain), "memory calls changed the keyed values"
    assert {r.source for r in report.records} == {"init_weights"}
    assert torch.equal(mine["pos"], torch.arange(16.0)) and torch.equal(mine["norm.weight"], torch.ones(16))
    # the shadowing methods are gone: the model manages its memory as usual again
    assert all("_apply" not in vars(m) for m in with_calls.modules())
    with_calls.to_empty(device="meta")
    assert with_calls.lin.weight.is_meta


def test_moves_keep_the_values_written_before():
    """``.to(device)``/``.cpu()`` copy: a deferred model's constructor values survive them."""
    moved, plain = keyinit.deferred(Net, ()), keyinit.deferred(Net, ())

    def init_pos(self: Net) -> None:  # the constructor's torch.empty buffer
        self.pos.copy_(torch.arange(16.0))

    def init_moves(self: Net) -> None:
        self.to("cpu")
        self.lin.cpu()
        init_pos(self)

    keyinit.materialize(moved, SEED, device="cpu", init_method=init_moves.__get__(moved))
    keyinit.materialize(plain, SEED, device="cpu", init_method=init_pos.__get__(plain))
    mine, expected = _state(moved), _state(plain)
    assert all(torch.equal(mine[k], expected[k]) for k in expected)
    assert torch.equal(mine["norm.weight"], torch.ones(16))


def test_to_empty_leaves_what_is_not_written_again_uninitialized():
    model = _meta(("to_empty", "skip_norm"))
    with pytest.raises(keyinit.PlanError, match=r"to_empty left these tensors uninitialized.*norm\.weight, norm\.bias"):
        _materialize(model)
    assert model.lin.weight.is_meta


def test_reading_after_to_empty_is_reading_uninitialized_memory():
    model = keyinit.deferred(Net, ("to_empty", "read", "skip_norm"))  # the constructor's ones are gone
    with pytest.raises(keyinit.PlanError, match=r"reads elements of norm\.weight that nothing wrote"):
        _materialize(model)


def test_a_dtype_conversion_is_an_error_naming_the_tensor():
    with pytest.raises(keyinit.PlanError, match=r"lin\.weight: init code converts it from torch\.float32 to "
                                                r"torch\.float16"):
        _materialize(_meta(("half",)))


# ----------------------------------------------------------------------------- real ranks
def _rank() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tests.init.test_model_dist import count_collectives

    results = {}
    for layout in ("fsdp", "tp"):
        model = _meta(("to_empty", "to", "cpu", "gather"))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if layout == "fsdp":
            fully_shard(model.lin, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            parallelize_module(model, mesh, {"lin": ColwiseParallel()})
        with count_collectives() as counts:
            _materialize(model)
        placements = sorted({str(p.placements) for p in model.parameters() if hasattr(p, "placements")})
        results[layout] = {"counts": counts, "placements": placements, "state": _state(model)}
    return results


@requires_gloo
def test_fsdp2_and_tp_ranks_bit_identical_without_collectives():
    expected = _meta(())
    _materialize(expected)
    expected_state = _state(expected)
    per_rank = run_distributed(_rank, 2, timeout=300)
    for rank, results in enumerate(per_rank):
        for layout, result in results.items():
            assert "Shard(dim=0)" in " ".join(result["placements"]), (layout, result["placements"])
            assert result["counts"] == {"c10d": 0, "comm_debug": 0}, (layout, rank, result["counts"])
            state = result["state"]
            differ = [k for k in expected_state if not torch.equal(state[k], expected_state[k])]
            assert not differ, f"{layout} rank {rank}: {differ} differ from one process"
