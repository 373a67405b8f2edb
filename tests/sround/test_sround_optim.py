"""keyinit.optim.stochastic_rounding: a bf16 model stepped in float32 and rounded by (seed, step, FQN, global
index); the keys of docs/spec.md 17.5, no float32 copy kept, a resume continues the keys, and a 2-rank
FSDP2 run gives one process's parameters bit for bit (gradients set from keyed values, so equal in every
layout)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import keyinit
from keyinit.optim import STEP_KEY, stochastic_rounding
from keyinit.random import stochastic_round
from tests._support.dist import requires_gloo, run_distributed

SEED = 11
GRAD_SEED = 99
STEPS = 4


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(7, 6)
        self.proj = torch.nn.Linear(6, 5)  # 5 rows over 2 ranks: an uneven shard
        self.head = torch.nn.Linear(5, 3, bias=False)
        self.norm = torch.nn.LayerNorm(3)  # stays float32 below


def _model() -> Tiny:
    model = Tiny()
    keyinit.init_model(model, seed=3)
    model.embed.to(torch.bfloat16)
    model.proj.to(torch.float16)
    model.head.to(torch.bfloat16)
    return model


def _region_of(param: torch.Tensor, fqn: str):
    return keyinit.layouts.target_for(param, fqn=fqn, module=torch.nn.Module(), name=fqn.rpartition(".")[2])


def _set_keyed_grads(model: torch.nn.Module, step: int) -> None:
    """Every gradient element a keyed value of (step, FQN, global index): equal in every layout."""
    for fqn, param in model.named_parameters():
        target = _region_of(param.data, fqn)
        k = keyinit.key_for(keyinit.fold_in(keyinit.key(GRAD_SEED), step), fqn)
        local = keyinit.random.normal(k, target.global_shape, std=0.3, dtype=param.dtype, region=target.region)
        if target.description.startswith("DTensor"):
            from torch.distributed.tensor import DTensor

            local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                       shape=param.shape, stride=param.stride())
        param.grad = local


def _train(model, make_opt, steps, start=0, opt=None):
    opt = opt if opt is not None else make_opt(model)
    for t in range(start, start + steps):
        _set_keyed_grads(model, t)
        opt.step()
        opt.zero_grad()
    return opt


def _sgd(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    stochastic_rounding(opt, SEED, names=model)
    return opt


def _adamw(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    stochastic_rounding(opt, SEED, names=model)
    return opt


def test_a_step_rounds_the_float32_update_with_the_spec_keys():
    model = _model()
    params = dict(model.named_parameters())
    before = {fqn: p.detach().clone() for fqn, p in params.items()}
    storage = {fqn: p.data_ptr() for fqn, p in params.items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = stochastic_rounding(opt, SEED, names=model)
    _set_keyed_grads(model, 0)
    grads = {fqn: p.grad for fqn, p in params.items()}
    opt.step()
    for fqn, p in params.items():
        assert p.dtype == before[fqn].dtype and p.data_ptr() == storage[fqn], fqn  # in place, same dtype
        assert p.grad is grads[fqn], fqn  # the gradient object given back
        update = before[fqn].float().add_(grads[fqn].float(), alpha=-0.05)  # SGD's float32 step
        if p.dtype == torch.float32:
            assert torch.equal(p.detach(), update), fqn  # not rounded
            continue
        # docs/spec.md 17.5: key_for(fold_in(fold_in(key(seed), "stochastic_rounding"), t), fqn)
        k = keyinit.key_for(keyinit.fold_in(keyinit.fold_in(keyinit.key(SEED), "stochastic_rounding"), 0), fqn)
        assert handle.key(0, fqn) == k
        expected = stochastic_round(k, update, p.dtype)
        assert torch.equal(p.detach().view(torch.int16), expected.view(torch.int16)), fqn
        assert not torch.equal(p.detach(), update.to(p.dtype)), fqn  # not round-to-nearest
    assert handle.step == 1 and all(g[STEP_KEY] == 1 for g in opt.param_groups)
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def _state(model):
    return {fqn: p.detach().clone() for fqn, p in model.named_parameters()}


def _assert_same(a, b, what):
    assert a.keys() == b.keys()
    for fqn in a:
        assert a[fqn].dtype == b[fqn].dtype and torch.equal(a[fqn], b[fqn]), f"{what}: {fqn} differs"


@pytest.mark.parametrize("make_opt", [_sgd, _adamw], ids=["sgd", "adamw"])
def test_a_resume_from_state_dict_continues_the_keys(make_opt):
    unbroken = _model()
    _train(unbroken, make_opt, STEPS)

    first = _model()
    opt = _train(first, make_opt, 2)
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved_opt["param_groups"][0][STEP_KEY] == 2
    resumed = _model()
    resumed.load_state_dict(saved_model)
    opt2 = make_opt(resumed)
    opt2.load_state_dict(saved_opt)
    assert all(v.dtype == torch.float32 for s in opt2.state.values() for v in s.values() if torch.is_tensor(v))
    assert {p.dtype for p in resumed.parameters()} == {torch.bfloat16, torch.float16, torch.float32}
    _train(resumed, make_opt, STEPS - 2, start=2, opt=opt2)
    _assert_same(_state(resumed), _state(unbroken), "resumed")

    # without the saved step, the keys restart at 0: the parameters differ
    restarted = _model()
    restarted.load_state_dict(saved_model)
    opt3 = make_opt(restarted)
    saved = copy.deepcopy(saved_opt)
    for group in saved["param_groups"]:
        group[STEP_KEY] = 0
    opt3.load_state_dict(saved)
    _train(restarted, make_opt, STEPS - 2, start=2, opt=opt3)
    assert not torch.equal(restarted.head.weight, unbroken.head.weight)


def test_other_seeds_round_differently_and_the_global_rng_is_untouched():
    a, b = _model(), _model()  # (their constructors draw from the global RNG; the steps must not)
    state = torch.get_rng_state()
    _train(a, _sgd, 2)
    opt = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    stochastic_rounding(opt, SEED + 1, names=b)
    _train(b, None, 2, opt=opt)
    assert not torch.equal(a.head.weight, b.head.weight)
    assert torch.equal(a.norm.weight, b.norm.weight)  # float32: not rounded, same update
    assert torch.equal(torch.get_rng_state(), state)


def test_errors_and_remove():
    model = _model()
    other = torch.nn.Linear(2, 2).to(torch.bfloat16)
    opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"a torch.bfloat16 parameter of shape \(2, 2\) in the optimizer is not a "
                                         r"parameter of `names`"):
        stochastic_rounding(opt, SEED, names=model)
    with pytest.raises(TypeError, match="names must be the model"):
        stochastic_rounding(opt, SEED, names=[1])
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        stochastic_rounding(model, SEED, names=model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = stochastic_rounding(opt, SEED, names=dict(model.named_parameters()))
    handle.remove()
    _set_keyed_grads(model, 0)
    expected = model.head.weight.detach().clone().add_(model.head.weight.grad, alpha=-0.1)  # plain bf16 SGD
    opt.step()
    assert torch.equal(model.head.weight.detach(), expected)


# ------------------------------------------------------------------------------------- FSDP2, 2 gloo ranks


def _fsdp2_run(steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model()
    for module in (model.embed, model.proj, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _train(model, _sgd, steps)
    placements = sorted({str(p.placements) for p in model.parameters()})
    state = {fqn: p.full_tensor() for fqn, p in model.named_parameters()}
    return state, placements, opt.param_groups[0][STEP_KEY], _dtensor_rounding(mesh)


def _dtensor_rounding(mesh):
    """stochastic_round of DTensors (rows and uneven columns sharded, replicated): DTensors of the same
    placements whose full tensors are the whole tensor's rounding."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    full = keyinit.random.normal(keyinit.key(5), (7, 5), std=3.0)
    out = []
    for placement in (Shard(0), Shard(1), Replicate()):
        x = distribute_tensor(full, mesh, [placement])
        rounded = stochastic_round(keyinit.key(SEED), x, torch.bfloat16)
        assert isinstance(rounded, DTensor) and tuple(rounded.placements) == (placement,)
        assert rounded.to_local().shape == x.to_local().shape and rounded.dtype == torch.bfloat16
        out.append(rounded.full_tensor())
    return out


@requires_gloo
def test_fsdp2_two_ranks_match_one_process_bitwise():
    single = _model()
    _train(single, _sgd, STEPS)
    expected = _state(single)
    whole = stochastic_round(keyinit.key(SEED), keyinit.random.normal(keyinit.key(5), (7, 5), std=3.0), torch.bfloat16)
    for rank, (state, placements, step, rounded) in enumerate(
            run_distributed(_fsdp2_run, 2, args=(STEPS,), timeout=240)):
        assert placements == ["(Shard(dim=0),)"], placements
        assert step == STEPS
        _assert_same(state, expected, f"FSDP2 rank {rank}")
        for full in rounded:
            assert torch.equal(full.view(torch.int16), whole.view(torch.int16)), f"DTensor rounding, rank {rank}"
