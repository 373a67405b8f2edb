"""The fused, stochastically rounded Adam/AdamW step (``docs/spec.md`` 17.6;
``keyinit.optim.stochastic_rounding(..., fused=True)``): its reference's float32 arithmetic is the spec's
(each operation rounded once, checked against exact rational arithmetic), the compiled kernel gives the
reference's bits (sizes, regions, threads, bfloat16/float16/float32 parameters), and the optimizer path
rounds ``adam_values`` with the spec's keys, keeps torch's state, resumes, hands the gradients back, and
refuses what it cannot compute as torch's Adam would."""

from __future__ import annotations

import copy
import importlib
import math
import os
from fractions import Fraction

import pytest
import torch

import keyinit
from keyinit._draw import reference_sround
from keyinit._kernels.fill import cpu as _cpu
from keyinit._kernels.fill import selftest_sround
from keyinit._kernels.fill.selftest import KEY_WORDS
from keyinit.keys import Key
from keyinit.optim import STEP_KEY, stochastic_rounding
from keyinit.random import stochastic_round
from keyinit.regions import make_region
from tests.sround.test_sround_optim import SEED, _model, _set_keyed_grads

_ON_CI = os.environ.get("CI", "").lower() == "true"
_KERNEL = _cpu.unchecked_library()
KEY = keyinit.key(77)
#: decay, w, beta2, s2, bc2s, eps, neg_step: AdamW's third step, and a w >= 0.5 (lerp's other form)
SCALARS = [
    ([1 - 1e-3, 0.1, 0.999, 1 - 0.999, (1 - 0.999 ** 3) ** 0.5, 1e-8, -1e-2 / (1 - 0.9 ** 3)], True),
    ([1.0, 0.7, 0.5, 0.5, 0.9, 1e-6, -0.3], False),
]


def _inputs(n: int, dtype: torch.dtype, seed: int = 0):
    """Parameters and gradients over many binades (subnormal float32 products included), moments."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-140, 20, (n,), generator=gen).float())
    p = (torch.randn(n, generator=gen) * scale).to(dtype)
    g = (torch.randn(n, generator=gen) * torch.exp2(torch.randint(-140, 5, (n,), generator=gen).float())).to(dtype)
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-4
    m[::7] = 0.0
    return p, g, m, v


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


# --------------------------------------------------------------------- the reference's arithmetic (17.6)


def _to_f32(x: Fraction) -> float:
    """The binary32 value nearest ``x`` (ties to even), finite range."""
    if x == 0:
        return 0.0
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e = e if Fraction(2) ** e <= a else e - 1  # floor(log2 a)
    q = Fraction(2) ** (max(e, -126) - 23)
    k, r = divmod(a, q)
    if r > q / 2 or (r == q / 2 and k % 2):
        k += 1
    return math.copysign(float(k * q), x)


def _spec_step(p, g, m0, v0, scalars, has_decay):
    """Section 17.6 on one element in exact rational arithmetic, rounded to binary32 after each operation."""
    r = _to_f32
    decay, w, beta2, s2, bc2s, eps, neg_step = (r(Fraction(s)) for s in scalars)
    F = Fraction
    if has_decay:
        p = r(F(p) * F(decay))
    d = r(F(g) - F(m0))
    m = r(F(w) * F(d) + F(m0)) if w < 0.5 else r(F(r(F(w) - 1)) * F(d) + F(g))
    v = r(F(r(F(s2) * F(g))) * F(g) + F(r(F(v0) * F(beta2))))
    den = r(F(r(F(r(F(math.sqrt(v)))) / F(bc2s))) + F(eps))
    new = r(F(r(F(r(F(neg_step) * F(m))) / F(den))) + F(p))
    return new, m, v


@pytest.mark.parametrize("scalars,has_decay", SCALARS, ids=["adamw", "w-large"])
def test_the_reference_rounds_each_operation_once(scalars, has_decay):
    p, g, m, v = _inputs(300, torch.float32, seed=1)
    new, m1, v1 = reference_sround.adam_values(p, g, m, v, scalars, has_decay)
    for i in range(len(p)):
        want = _spec_step(p[i].item(), g[i].item(), m[i].item(), v[i].item(), scalars, has_decay)
        assert (new[i].item(), m1[i].item(), v1[i].item()) == want, i


def test_the_fused_arithmetic_differs_from_torch_only_by_its_square_root():
    """torch's AdamW on float32 parameters with its sqrt replaced by a correctly rounded one is 17.6."""
    n = 4099
    p, g, m, v = _inputs(n, torch.float32, seed=2)
    param = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1)
    opt.state[param] = {"step": torch.tensor(2.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    param.grad = g
    exact_sqrt = torch.Tensor.sqrt

    def sqrt(t):  # correctly rounded: via binary64 (innocuous double rounding for sqrt)
        return exact_sqrt(t.double()).float()

    torch.Tensor.sqrt = sqrt
    try:
        opt.step()
    finally:
        torch.Tensor.sqrt = exact_sqrt
    scalars = [1 - 1e-3, 0.1, 0.999, 1 - 0.999, (1 - 0.999 ** 3) ** 0.5, 1e-8, -(1e-2 / (1 - 0.9 ** 3))]
    new, m1, v1 = reference_sround.adam_values(p, g, m, v, scalars, True)
    assert torch.equal(_bits(m1), _bits(opt.state[param]["exp_avg"]))
    assert torch.equal(_bits(v1), _bits(opt.state[param]["exp_avg_sq"]))
    assert torch.equal(_bits(new), _bits(param.detach()))


# -------------------------------------------------------------------------- the kernel is the reference


@pytest.mark.skipif(_KERNEL is None and not _ON_CI, reason="compiled CPU kernel unavailable")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("scalars,has_decay", SCALARS, ids=["adamw", "w-large"])
def test_the_kernel_gives_the_reference_bits(dtype, scalars, has_decay):
    assert _KERNEL is not None, "CI=true and the compiled CPU kernel cannot be built"
    cases = [((n,), None, 1) for n in (1, 5, 31, 33, 257)] + [((70001,), None, 2), ((9, 300), (slice(2, 7), slice(3, 290)), 1)]
    for shape, region, threads in cases:
        reg = make_region(shape, region)
        p, g, m, v = (t.reshape(reg.region_shape) for t in _inputs(math.prod(reg.region_shape), dtype, seed=len(cases)))
        mine = [p.clone(), g, m.clone(), v.clone()]
        ref = [p.clone(), g, m.clone(), v.clone()]
        assert _cpu.sround_adam(*mine, KEY, reg, scalars, has_decay, threads=threads, lib=_KERNEL)
        reference_sround.adam_into(*ref, KEY, reg, scalars, has_decay)
        for what, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), mine, ref):
            assert torch.equal(_bits(a), _bits(b)), (what, shape, region, threads)
    assert not _cpu.sround_adam(p.t(), g.t(), m.t(), v.t(), KEY, make_region((300, 5), None), scalars, has_decay,
                                lib=_KERNEL)  # not contiguous: declined, nothing written


def test_the_load_time_golden_digests_are_the_references():
    key = Key(*KEY_WORDS)
    for name, dtype, shape, region, which, _ in selftest_sround.adam_cases():
        reg = make_region(shape, region)
        p, g, m, v = (t.reshape(reg.region_shape) for t in selftest_sround.adam_inputs(reg.numel, dtype))
        reference_sround.adam_into(p, g, m, v, key, reg, *selftest_sround.ADAM_SCALARS[which])
        assert selftest_sround.adam_digest(p, m, v) == selftest_sround.GOLDEN_ADAM[name], name
    assert sorted(selftest_sround.GOLDEN_ADAM) == sorted(c[0] for c in selftest_sround.adam_cases())
    if _KERNEL is not None:
        assert selftest_sround.run_adam(lambda p, g, m, v, k, r, s, d, t: _cpu.sround_adam(
            p, g, m, v, k, r, s, d, threads=t, lib=_KERNEL)) == []


# ---------------------------------------------------------------------------------- the optimizer path


def _fused(model, **options):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, **options)
    stochastic_rounding(opt, SEED, names=model, fused=True)
    return opt


def _train(model, opt, steps, start=0):
    for t in range(start, start + steps):
        _set_keyed_grads(model, t)
        opt.step()
        opt.zero_grad()


def test_a_fused_step_rounds_the_spec_values_with_the_spec_keys():
    model = _model()
    opt = _fused(model)
    _train(model, opt, 1)  # the state exists from here on
    params = dict(model.named_parameters())
    before = {fqn: p.detach().clone() for fqn, p in params.items()}
    state = {fqn: {k: v.clone() for k, v in opt.state[p].items()} for fqn, p in params.items()}
    _set_keyed_grads(model, 1)
    grads = {fqn: p.grad for fqn, p in params.items()}
    rng = torch.get_rng_state()
    opt.step()
    assert torch.equal(torch.get_rng_state(), rng)
    lr, wd, (b1, b2), eps = 0.01, 0.1, (0.9, 0.999), 1e-8
    for fqn, p in params.items():
        assert p.grad is grads[fqn], fqn  # given back
        if p.dtype == torch.float32:
            continue  # torch's own step
        s = state[fqn]
        assert s["exp_avg"].dtype == torch.float32 and s["step"].item() == 1.0
        scalars = [1 - lr * wd, 1 - b1, b2, 1 - b2, (1 - b2 ** 2) ** 0.5, eps, -(lr / (1 - b1 ** 2))]
        new, m, v = reference_sround.adam_values(before[fqn], grads[fqn], s["exp_avg"], s["exp_avg_sq"], scalars, True)
        k = keyinit.key_for(keyinit.fold_in(keyinit.fold_in(keyinit.key(SEED), "stochastic_rounding"), 1), fqn)
        assert torch.equal(_bits(p.detach()), _bits(stochastic_round(k, new, p.dtype))), fqn
        assert torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["exp_avg_sq"], v), fqn
        assert opt.state[p]["step"].item() == 2.0
    assert opt.param_groups[0][STEP_KEY] == 2


def test_the_reference_path_and_a_resume_give_the_same_parameters(monkeypatch):
    unbroken = _model()
    _train(unbroken, _fused(unbroken), 4)
    first = _model()
    opt = _fused(first)
    _train(first, opt, 2)
    saved_model, saved_opt = copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = _model()
    resumed.load_state_dict(saved_model)
    opt2 = _fused(resumed)
    opt2.load_state_dict(saved_opt)
    monkeypatch.setenv("KEYINIT_DISABLE_KERNELS", "1")  # the rest on the reference
    _train(resumed, opt2, 2, start=2)
    for (fqn, a), b in zip(resumed.named_parameters(), unbroken.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), fqn


def test_errors_leave_the_optimizer_as_found():
    model = _model()
    with pytest.raises(TypeError, match=r"fused=True takes torch.optim.Adam or torch.optim.AdamW, got "
                                        r"torch.optim.sgd.SGD"):
        stochastic_rounding(torch.optim.SGD(model.parameters(), lr=0.1), SEED, names=model, fused=True)
    for make, message in (
            (lambda: torch.optim.AdamW(model.parameters(), amsgrad=True), r"does not step amsgrad=True \(parameter"),
            (lambda: torch.optim.Adam(model.parameters(), weight_decay=0.1),
             r"steps decoupled weight decay only \(AdamW\); Adam's weight_decay=0.1 adds it to the gradient"),
            (lambda: torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01)),
             r"needs a Python number for lr, got Tensor")):
        opt = make()
        stochastic_rounding(opt, SEED, names=model, fused=True)
        _set_keyed_grads(model, 0)
        grads = [p.grad for p in model.parameters()]
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises((ValueError, TypeError), match=message):
            opt.step()
        assert all(p.grad is g for p, g in zip(model.parameters(), grads))
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not opt.state
        assert opt.param_groups[0][STEP_KEY] == 0
    # Adam without weight decay is AdamW's arithmetic: fused
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    stochastic_rounding(opt, SEED, names=model, fused=True)
    opt.step()
    assert opt.param_groups[0][STEP_KEY] == 1


def test_a_step_that_raises_gives_the_gradients_back(monkeypatch):
    model = _model()
    opt = _fused(model)
    _set_keyed_grads(model, 0)

    def fails(*args, **kwargs):  # torch's own step (of the float32 parameters) raises
        raise RuntimeError("the optimizer failed")

    monkeypatch.setattr(importlib.import_module("torch.optim.adam"), "_single_tensor_adam", fails)
    grads = {fqn: p.grad for fqn, p in model.named_parameters()}
    before = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="the optimizer failed"):
        opt.step()
    for fqn, p in model.named_parameters():
        assert p.grad is grads[fqn], fqn
        if p.dtype != torch.float32:
            assert torch.equal(p, before[fqn]) and not opt.state[p], fqn  # the fused step never ran
    assert opt.param_groups[0][STEP_KEY] == 0
    monkeypatch.undo()
    opt.step()  # and the next step is a whole one
    assert opt.param_groups[0][STEP_KEY] == 1 and opt.state[model.head.weight]["step"].item() == 1.0
