"""keyinit.optim.stochastic_rounding when a step raises: the float32 stand-ins never stay in the parameter
groups or the optimizer state (the original parameters and their state are back before the exception
leaves ``optimizer.step()``), the counter does not advance, and the next step is the one a run without the
failure takes; also with an LR scheduler wrapping the step, and after ``remove()``."""

from __future__ import annotations

import pytest
import torch

import keyinit
import keyinit.optim
from keyinit.optim import STEP_KEY, stochastic_rounding

SEED = 11


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    keyinit.init_model(model, seed=3)
    model[0].to(torch.bfloat16)
    model[1].to(torch.float16)
    return model


def _grads(model: torch.nn.Module, step: int) -> None:
    for fqn, param in model.named_parameters():
        k = keyinit.key_for(keyinit.fold_in(keyinit.key(99), step), fqn)
        param.grad = keyinit.random.normal(k, param.shape, std=0.3, dtype=param.dtype)


class FailingAdamW(torch.optim.AdamW):
    """AdamW whose step raises after stepping, so its float32 stand-ins are in the groups and state."""

    fail = False

    def step(self, closure=None):
        result = super().step(closure)
        if self.fail:
            raise RuntimeError("step failed")
        return result


def _snapshot(model, opt):
    params = list(model.parameters())
    return ([p.detach().clone() for p in params], [list(g["params"]) for g in opt.param_groups],
            {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in params})


def _assert_restored(model, opt, values, step):
    params = list(model.parameters())
    for group in opt.param_groups:
        assert all(any(p is q for q in params) for p in group["params"]), "a stand-in stayed in the groups"
        assert group[STEP_KEY] == step
    assert all(any(p is q for q in params) for p in opt.state), "a stand-in stayed in the optimizer state"
    for p, v in zip(params, values):
        assert p.dtype == v.dtype and torch.equal(p.detach(), v)


def _steps(model, opt, steps, fail_at=None):
    for t in range(steps):
        _grads(model, t)
        if t == fail_at:
            opt.fail = True
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(RuntimeError, match="step failed"):
                opt.step()
            opt.fail = False
            _assert_restored(model, opt, before, t)
            if t == 0:
                opt.state.clear()  # the failed first step made state: the unbroken run has none
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("scheduler", [False, True], ids=["plain", "lr-scheduler"])
def test_a_step_that_raises_puts_the_parameters_back(scheduler):
    model = _model()
    opt = FailingAdamW(model.parameters(), lr=0.01)
    handle = stochastic_rounding(opt, SEED, names=model)
    if scheduler:  # wraps opt.step (through its __func__) after ours
        torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    _steps(model, opt, 1)
    opt.fail = True
    _grads(model, 1)
    values, groups, state = _snapshot(model, opt)
    with pytest.raises(RuntimeError, match="step failed"):
        opt.step()
    assert [list(g["params"]) for g in opt.param_groups] == groups  # the same objects, in place
    assert not handle._swapped
    _assert_restored(model, opt, values, 1)
    for p in model.parameters():
        assert opt.state[p].keys() == state[id(p)].keys()
        assert all(v.dtype == torch.float32 for v in opt.state[p].values() if torch.is_tensor(v) and v.dim())


def test_the_step_after_a_failure_is_the_unbroken_runs():
    plain, unbroken, broken = _model(), _model(), _model()
    for model, fail_at, make in ((plain, None, torch.optim.AdamW), (unbroken, None, FailingAdamW),
                                 (broken, 0, FailingAdamW)):
        opt = make(model.parameters(), lr=0.01)
        stochastic_rounding(opt, SEED, names=model)
        _steps(model, opt, 3, fail_at=fail_at)
        assert opt.param_groups[0][STEP_KEY] == 3  # a subclass's super().step() (hooks twice) counts once
        for a, b in zip(plain.parameters(), model.parameters()):
            assert torch.equal(a.detach(), b.detach())


def test_a_rounding_that_raises_puts_the_parameters_back(monkeypatch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stochastic_rounding(opt, SEED, names=model)
    _grads(model, 0)
    values, _, _ = _snapshot(model, opt)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("rounding failed")

    monkeypatch.setattr(keyinit.optim.dispatch, "sround_many", failing)
    with pytest.raises(RuntimeError, match="rounding failed"):
        opt.step()
    assert calls == [1]
    _assert_restored(model, opt, values, 0)


def test_remove_gives_back_the_optimizers_own_step():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = stochastic_rounding(opt, SEED, names=model)
    assert "step" in vars(opt)
    handle.remove()
    handle.remove()
    assert "step" not in vars(opt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = stochastic_rounding(opt, SEED, names=model)
    torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    wrapped = opt.step
    handle.remove()  # the scheduler's wrapper stays (ours inside it only passes through)
    assert opt.step is wrapped
    _grads(model, 0)
    expected = [p.detach().clone().add_(p.grad, alpha=-0.1) for p in model.parameters()]  # plain low-precision SGD
    opt.step()
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p.detach(), e)
