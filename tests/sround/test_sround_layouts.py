"""Keyed stochastic rounding across layouts: a bf16/fp16 model trained with ``stochastic_rounding`` AdamW (the
float32 path and ``fused=True``) from gradients equal in every layout (keyed values of (step, FQN, global
index)) has bitwise the same parameters on 1 process, 2 and 4 FSDP2 gloo ranks and 4 FSDP2xTP ranks (2x2,
uneven shards); and a run saved on one world size (the optimizer's full state dict, which carries the SR
step) and resumed on another continues bit for bit: 1 -> 2, 2 -> 4 (FSDP2) and 4 (FSDP2xTP) -> 1."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from keyinit.optim import STEP_KEY, stochastic_rounding
from tests._support.dist import requires_gloo, run_distributed
from tests.sround.test_sround_optim import SEED, _model, _set_keyed_grads

STEPS = 3
SAVED_AT = 2
FUSED = (False, True)


def _opt(model, fused):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    stochastic_rounding(opt, SEED, names=model, fused=fused)
    return opt


def _steps(model, opt, start, stop):
    for t in range(start, stop):
        _set_keyed_grads(model, t)
        opt.step()
        opt.zero_grad()


def _params(model):
    return {fqn: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for fqn, p in model.named_parameters()}


def _single(fused):
    """One process: (the parameters after STEPS steps, the model and optimizer state after SAVED_AT)."""
    model = _model()
    opt = _opt(model, fused)
    _steps(model, opt, 0, SAVED_AT)
    saved = (copy.deepcopy(model.state_dict()), _full_optim_state(model, opt))
    _steps(model, opt, SAVED_AT, STEPS)
    return _params(model), saved


def _full_optim_state(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return copy.deepcopy(state)


def _load_optim_state(model, opt, state):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, copy.deepcopy(state), options=StateDictOptions(full_state_dict=True))


def _sharded(layout):
    """The model laid out: ``fsdp`` (1-D mesh of every rank) or ``fsdp_tp`` (2 x 2: TP inside FSDP2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    world = dist.get_world_size()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh2["tp"], {"embed": RowwiseParallel(), "proj": ColwiseParallel(),
                                                "head": RowwiseParallel()})
        mesh = mesh2["dp"]
    for module in (model.embed, model.proj, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_model_state(model):
    return {fqn: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for fqn, t in model.state_dict().items()}


def _load_model_state(model, state):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, copy.deepcopy(state), options=StateDictOptions(full_state_dict=True))


def _ranks(layouts, resume):
    """In every rank: for each layout and each fused, the full parameters after STEPS steps, the placements,
    the SR step; the state saved after SAVED_AT; and, given ``resume`` (a state saved elsewhere), the
    parameters after resuming from it."""
    out = {}
    for layout in layouts:
        for fused in FUSED:
            model = _sharded(layout)
            opt = _opt(model, fused)
            _steps(model, opt, 0, SAVED_AT)
            saved = (_full_model_state(model), _full_optim_state(model, opt))
            _steps(model, opt, SAVED_AT, STEPS)
            placements = sorted({str(p.placements) for p in model.parameters()})
            entry = {"params": _params(model), "placements": placements, "step": opt.param_groups[0][STEP_KEY],
                     "saved": saved}
            if resume is not None and layout == "fsdp":
                # (torch's set_*_state_dict cannot place a full tensor on an uneven _StridedShard, FSDP2xTP's
                # layout here: distribute_tensor asserts. FSDP2xTP's state is resumed on 1 process below)
                model = _sharded(layout)
                opt = _opt(model, fused)
                model_state, optim_state = resume[fused]
                _load_model_state(model, model_state)
                _load_optim_state(model, opt, optim_state)
                assert opt.param_groups[0][STEP_KEY] == SAVED_AT
                _steps(model, opt, SAVED_AT, STEPS)
                entry["resumed"] = _params(model)
            out[(layout, fused)] = entry
    return out


def _assert_same(got, want, what):
    assert got.keys() == want.keys(), what
    for fqn in want:
        a, b = got[fqn], want[fqn]
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {fqn} differs"


@pytest.mark.slow  # two real multi-process runs (2 and 4 ranks): 13 s on 2 cores, 35 s when they are busy
@requires_gloo
def test_one_two_and_four_ranks_and_resumes_across_world_sizes_round_alike():
    single = {fused: _single(fused) for fused in FUSED}
    for fused in FUSED:  # the control: another seed rounds differently
        other = _model()
        opt = torch.optim.AdamW(other.parameters(), lr=0.01, weight_decay=0.1)
        stochastic_rounding(opt, SEED + 1, names=other, fused=fused)
        _steps(other, opt, 0, STEPS)
        assert not torch.equal(other.embed.weight, single[fused][0]["embed.weight"])

    # 1 process -> 2 FSDP2 ranks: the same steps; the resume of one process's state on 2 ranks
    two = run_distributed(_ranks, 2, args=(("fsdp",), {f: single[f][1] for f in FUSED}), timeout=300)
    for rank, result in enumerate(two):
        for fused in FUSED:
            entry = result[("fsdp", fused)]
            assert entry["placements"] == ["(Shard(dim=0),)"] and entry["step"] == STEPS
            _assert_same(entry["params"], single[fused][0], f"2 FSDP2 ranks, fused={fused}, rank {rank}")
            _assert_same(entry["resumed"], single[fused][0], f"1 -> 2 ranks resume, fused={fused}, rank {rank}")

    # 2 ranks' state -> 4 ranks (FSDP2 and FSDP2xTP) and -> 1 process
    saved_on_two = {f: two[0][("fsdp", f)]["saved"] for f in FUSED}
    four = run_distributed(_ranks, 4, args=(("fsdp", "fsdp_tp"), saved_on_two), timeout=400)
    for rank, result in enumerate(four):
        for fused in FUSED:
            for layout in ("fsdp", "fsdp_tp"):
                entry = result[(layout, fused)]
                what = f"4 ranks {layout}, fused={fused}, rank {rank}"
                _assert_same(entry["params"], single[fused][0], what)
                if layout == "fsdp":
                    _assert_same(entry["resumed"], single[fused][0], f"2 -> {what} resume")
            assert any("_StridedShard" in p or "Shard(dim=1)" in p for p in result[("fsdp_tp", fused)]["placements"])
    for fused in FUSED:
        model_state, optim_state = four[0][("fsdp_tp", fused)]["saved"]
        model = _model()
        opt = _opt(model, fused)
        model.load_state_dict(model_state)
        _load_optim_state(model, opt, optim_state)
        _steps(model, opt, SAVED_AT, STEPS)
        _assert_same(_params(model), single[fused][0], f"4 ranks FSDP2xTP -> 1 process resume, fused={fused}")
