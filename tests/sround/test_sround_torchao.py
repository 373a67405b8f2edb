"""torchao's Adam/AdamW keyed by one call: ``stochastic_rounding(torchao_optimizer, seed, names=model)`` rounds
torchao's own float32 update with keyinit's key (bitwise ``stochastic_round(key(t, fqn), update)``), keeps
torchao's state format (bfloat16, or the 8-bit, 4-bit and FP8 quantized states of its low-bit optimizers),
never touches the global RNG, and gives bitwise the same parameters on 2 FSDP2 gloo ranks as on 1 process."""

from __future__ import annotations

import copy

import pytest
import torch

import keyinit
from keyinit.optim import stochastic_rounding
from tests._support.dist import requires_gloo, run_distributed

torchao_optim = pytest.importorskip("torchao.optim")

SEED = 21
STEPS = 3


class Pair(torch.nn.Module):
    """Two bf16 parameters of one shape (one compiled torchao step for both). 4 rows: even on 2 ranks (with
    uneven shards, 3 and 2 rows, torch 2.13's compiled cache gave one rank's graph to the other's DTensor
    step, a size assertion in torchao's step; keyinit's rounding of uneven shards is tested elsewhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 4, bias=False)
        self.b = torch.nn.Linear(6, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x) * self.b(x)).sum()


def _model() -> Pair:
    model = Pair()
    keyinit.init_model(model, seed=4)
    return model.to(torch.bfloat16)


def _opt(params):
    return torchao_optim._AdamW(params, lr=0.01, weight_decay=0.1, bf16_stochastic_round=True)


def _keyed_grads(model, step):
    """Gradients equal in every layout: keyed values of (step, FQN, global index)."""
    for fqn, param in model.named_parameters():
        target = keyinit.layouts.target_for(param.data, fqn=fqn, module=torch.nn.Module(), name=fqn[-6:])
        k = keyinit.key_for(keyinit.fold_in(keyinit.key(99), step), fqn)
        local = keyinit.random.normal(k, target.global_shape, std=0.3, dtype=param.dtype, region=target.region)
        if target.description.startswith("DTensor"):
            from torch.distributed.tensor import DTensor

            local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                       shape=param.shape, stride=param.stride())
        param.grad = local


def _train(model):
    opt = _opt(model.parameters())
    stochastic_rounding(opt, SEED, names=model)
    for t in range(STEPS):
        _keyed_grads(model, t)
        opt.step()
        opt.zero_grad()
    return {fqn: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for fqn, p in model.named_parameters()}


@pytest.mark.slow  # torchao compiles its step with inductor: ~10-30 s on 2 cores
def test_torchao_adamw_rounds_its_float32_update_with_the_key():
    model = _model()
    opt = _opt(model.parameters())
    handle = stochastic_rounding(opt, SEED, names=model)
    # the reference: torchao's own step on float32 copies with the same state, rounded by keyinit
    ref_params = {fqn: torch.nn.Parameter(p.detach().float()) for fqn, p in model.named_parameters()}
    ref = _opt(list(ref_params.values()))
    rng = torch.get_rng_state()
    stochastic = 0
    for t in range(STEPS):
        model(torch.linspace(-1, 1, 12, dtype=torch.bfloat16).reshape(2, 6) * (t + 1)).backward()
        for fqn, param in model.named_parameters():
            ref_params[fqn].data.copy_(param.detach().float())
            ref_params[fqn].grad = param.grad.float()
            if t:
                ref.state[ref_params[fqn]] = copy.deepcopy(opt.state[param])
        ref.step()
        opt.step()
        opt.zero_grad()
        for fqn, param in model.named_parameters():
            update = ref_params[fqn].detach()
            want = keyinit.random.stochastic_round(handle.key(t, fqn), update, torch.bfloat16)
            assert torch.equal(param.detach(), want), f"step {t}: {fqn}"
            stochastic += int((want != update.to(torch.bfloat16)).sum())
            assert opt.state[param]["exp_avg"].dtype == torch.bfloat16  # torchao's format for a bf16 parameter
            assert opt.state[param]["step"] == t + 1
    assert stochastic > 0  # some elements rounded away from the nearest: the key decided them
    assert torch.equal(torch.get_rng_state(), rng)  # torchao's torch.randint never ran

    # its state saves and loads in torchao's format, the SR step with it
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    again = _opt(fresh.parameters())
    stochastic_rounding(again, SEED, names=fresh)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))  # (as saved: torch shares the step tensors)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in again.state.values())
    for m, o in ((model, opt), (fresh, again)):
        _keyed_grads(m, STEPS)
        o.step()
    for (fqn, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), fqn


def _two_ranks():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    rng = torch.get_rng_state()
    params = _train(model)
    return params, torch.equal(torch.get_rng_state(), rng)


@pytest.mark.slow  # two ranks, each compiling torchao's step for its shard: ~30-60 s on 2 cores
@requires_gloo
def test_torchao_adamw_on_two_fsdp2_ranks_rounds_as_one_process():
    single = _train(_model())
    for rank, (params, rng_kept) in enumerate(run_distributed(_two_ranks, 2, timeout=400)):
        assert rng_kept, rank
        assert params.keys() == single.keys()
        for fqn in single:
            assert torch.equal(params[fqn], single[fqn]), f"rank {rank}: {fqn}"


@pytest.mark.slow  # torchao compiles each optimizer's step: ~5-20 s on 2 cores
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_torchao_low_bit_optimizers_keep_their_state_format_and_round_with_the_key(name):
    cls = getattr(torchao_optim, name)
    model = torch.nn.Linear(128, 64, bias=False)  # 8192 elements: torchao quantizes its state (>= 4096)
    keyinit.init_model(model, seed=1)
    model.to(torch.bfloat16)
    opt = cls(model.parameters(), lr=0.01, bf16_stochastic_round=True)
    handle = stochastic_rounding(opt, SEED, names=model)
    ref_param = torch.nn.Parameter(model.weight.detach().float())
    ref = cls([ref_param], lr=0.01)
    rng = torch.get_rng_state()
    # the first step from both optimizers' zero state (torchao's quantized state has no deepcopy/clone: later
    # steps are compared across layouts above, for _AdamW)
    _keyed_grads(model, 0)
    ref_param.grad = model.weight.grad.float()
    ref.step()
    opt.step()
    want = keyinit.random.stochastic_round(handle.key(0, "weight"), ref_param.detach(), torch.bfloat16)
    assert torch.equal(model.weight.detach(), want), name
    assert bool((want != ref_param.detach().to(torch.bfloat16)).any())  # the key decided some roundings
    _keyed_grads(model, 1)
    opt.step()  # from torchao's state
    assert type(opt.state[model.weight]["exp_avg"]).__name__.startswith("OptimState")  # torchao's quantized state
    assert torch.equal(torch.get_rng_state(), rng)
