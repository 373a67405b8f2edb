"""keyinit.optim.stochastic_rounding under ``torch.compile`` of the step: ``torch.compile(optimizer.step)``, a
compiled function that calls it, and a compiled train step (backward included) compile in the first two steps
only (the hooks run eagerly, the float32 stand-ins are the same tensor objects every step: no recompile per
step, with an LR scheduler too), and give bitwise what the keyed step promises: torch's compiled optimizer
arithmetic over float32 copies, rounded with the keys (a reference built without the hooks, aot_eager and
inductor); the fused step's parameters and state are the eager ones, and so is everything with SGD, whose
compiled arithmetic is its eager one (torch's compiled Adam/AdamW is not, keyed or not). No float32 copy is
held between steps, FSDP2's DTensor parameters on two ranks step as one eager process, a resume continues the
keys, a step that raises puts everything back, the global RNG is untouched, and ``fullgraph=True`` is refused
with a message saying why."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import keyinit
import keyinit.optim
from keyinit.optim import STEP_KEY, stochastic_rounding
from keyinit.random import stochastic_round
from tests._support.dist import requires_gloo, run_distributed

SEED = 21
STEPS = 5

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}
CASES = [("sgd", False), ("adam", False), ("adam", True), ("adamw", False), ("adamw", True)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model() -> torch.nn.Module:
    """bfloat16 and float16 parameters (keyed) and a float32 one (stepped by the optimizer as usual)."""
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(6, 5), "b": torch.nn.Linear(5, 3), "n": torch.nn.LayerNorm(3)})
    keyinit.init_model(model, seed=3)
    model["a"].to(torch.bfloat16)
    model["b"].to(torch.float16)
    return model


def _grads(model: torch.nn.Module, step: int, dtypes: Optional[dict] = None) -> None:
    """Keyed gradients, drawn in each parameter's dtype (``dtypes[fqn]`` if given) and cast to it."""
    for fqn, param in model.named_parameters():
        k = keyinit.key_for(keyinit.fold_in(keyinit.key(99), step), fqn)
        grad = keyinit.random.normal(k, param.shape, std=0.3, dtype=(dtypes or {}).get(fqn, param.dtype))
        param.grad = grad.to(param.dtype)


def _setup(kind: str, fused: bool):
    model = _model()
    opt = OPTIMIZERS[kind](model.parameters())
    return model, opt, stochastic_rounding(opt, SEED, names=model, fused=fused)


def _eager(kind: str, fused: bool, steps: int = STEPS):
    model, opt, sr = _setup(kind, fused)
    for t in range(steps):
        _grads(model, t)
        opt.step()
    return model, opt


def _assert_same(model, opt, ref_model, ref_opt, where: str) -> None:
    for (fqn, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert p.dtype == q.dtype and torch.equal(p.detach(), q.detach()), f"{fqn} {where}"
        state, ref = opt.state[p], ref_opt.state[q]
        assert state.keys() == ref.keys(), fqn
        for name, value in ref.items():
            assert state[name].dtype == value.dtype and torch.equal(state[name], value), f"{fqn} {name} {where}"
    assert [g[STEP_KEY] for g in opt.param_groups] == [g[STEP_KEY] for g in ref_opt.param_groups]


def _assert_nothing_held(model, opt, sr) -> None:
    """The optimizer holds the model's parameters (no float32 stand-in in its groups or state), and the stand-in
    objects kept for the next step hold no storage between steps."""
    params = list(model.parameters())
    assert all(any(p is q for q in params) for g in opt.param_groups for p in g["params"])
    assert all(any(p is q for q in params) for p in opt.state)
    assert len(sr._stand_ins) == (0 if sr.fused else 4)  # the bfloat16 and float16 weights and biases
    for _, stand_in, _, _ in sr._stand_ins.values():
        assert stand_in.untyped_storage().nbytes() == 0
        assert stand_in.grad is None or stand_in.grad.untyped_storage().nbytes() == 0


def _reference(kind: str, fused: bool, backend: str, steps: int = STEPS, make=None, lambda_lr=None):
    """What the keyed step promises, built without its hooks: torch's optimizer compiled with ``backend`` over
    float32 parameters holding the low-precision values (the float32 path; with ``fused`` those get no gradient,
    the fused step is checked against the eager one), then each low-precision one rounded with its key."""
    model = _model()
    dtypes = {fqn: p.dtype for fqn, p in model.named_parameters()}
    model.float()
    opt = (make or OPTIMIZERS[kind])(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda_lr) if lambda_lr else None
    step = torch.compile(opt.step, backend=backend)
    base = keyinit.fold_in(keyinit.key(SEED), keyinit.optim.TAG)
    for t in range(steps):
        _grads(model, t, dtypes)
        if fused:
            for fqn, p in model.named_parameters():
                if dtypes[fqn] != torch.float32:
                    p.grad = None
        step()
        with torch.no_grad():
            for fqn, p in model.named_parameters():
                if dtypes[fqn] != torch.float32 and p.grad is not None:
                    p.copy_(stochastic_round(keyinit.key_for(keyinit.fold_in(base, t), fqn), p, dtypes[fqn]))
        if schedule is not None:
            schedule.step()
    return model, opt


def _assert_matches(model, opt, sr, backend: str, kind: str, fused: bool) -> None:
    """The compiled keyed run against :func:`_reference` (its float32 parts) and, for the fused parts, against
    the eager keyed run, bitwise."""
    ref_model, ref_opt = _reference(kind, fused, backend)
    eager_model, eager_opt = _eager(kind, fused)
    for (fqn, p), q, e in zip(model.named_parameters(), ref_model.parameters(), eager_model.parameters()):
        if fused and p.dtype != torch.float32:
            q, ref_state = e, eager_opt.state[e]
        else:
            ref_state = ref_opt.state[q]
        assert torch.equal(p.detach(), q.detach().to(p.dtype)), f"{fqn} ({backend})"
        assert opt.state[p].keys() == ref_state.keys(), fqn
        for name, value in ref_state.items():
            got = opt.state[p][name]
            assert got.dtype == value.dtype and torch.equal(got, value), f"{fqn} {name} ({backend})"
    assert sr.step == STEPS


def _compiled_run(kind: str, fused: bool, backend: str):
    model, opt, sr = _setup(kind, fused)
    counter = CompileCounterWithBackend(backend)
    step = torch.compile(opt.step, backend=counter)
    rng = torch.get_rng_state()
    frames = []
    for t in range(STEPS):
        _grads(model, t)
        with torch._dynamo.config.patch(error_on_recompile=t >= 2):  # steps 0 and 1 make the state
            step()
        frames.append(counter.frame_count)
        _assert_nothing_held(model, opt, sr)
    assert frames[1] == frames[-1] >= 1, frames  # no frame compiled after the second step
    assert torch.equal(torch.get_rng_state(), rng)
    return model, opt, sr


@pytest.mark.parametrize("kind,fused", CASES, ids=[f"{k}-{'fused' if f else 'float32'}" for k, f in CASES])
def test_compiled_step_rounds_torchs_compiled_update_with_the_keys_and_compiles_once(kind, fused):
    model, opt, sr = _compiled_run(kind, fused, "aot_eager")
    _assert_matches(model, opt, sr, "aot_eager", kind, fused)
    if kind == "sgd":  # torch's compiled SGD is its eager SGD bitwise (its Adam's exp_avg_sq is not): so is ours
        _assert_same(model, opt, *_eager(kind, fused), "compiled against eager")


@pytest.mark.slow  # inductor compiles on the CPU: ~10 s a case on 2 cores
@pytest.mark.parametrize("kind,fused", [("sgd", False), ("adamw", True)], ids=["sgd-float32", "adamw-fused"])
def test_inductor(kind, fused):
    model, opt, sr = _compiled_run(kind, fused, "inductor")
    _assert_matches(model, opt, sr, "inductor", kind, fused)


def test_a_compiled_function_calling_step_and_resume():
    """A compiled function that sets the gradients and steps; a run saved after 3 steps and loaded into a new
    optimizer continues the same keys: bitwise the uninterrupted compiled run."""
    whole, whole_opt, _ = _compiled_run("adamw", False, "aot_eager")
    model, opt, sr = _setup("adamw", False)

    def train_step(m, o, grads):
        for p, g in zip(m.parameters(), grads):
            p.grad = g
        o.step()

    def grads(m, t):
        _grads(m, t)
        return [p.grad for p in m.parameters()]

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(train_step, backend=counter)
    for t in range(3):
        compiled(model, opt, grads(model, t))
    saved, values = opt.state_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()}
    frames = counter.frame_count

    resumed = _model()
    resumed.load_state_dict(values)
    opt2 = OPTIMIZERS["adamw"](resumed.parameters())
    sr2 = stochastic_rounding(opt2, SEED, names=resumed)
    opt2.load_state_dict(saved)
    assert sr2.step == 3 and opt2.state[resumed["a"].weight]["exp_avg"].dtype == torch.float32
    for t in range(3, STEPS):
        compiled(resumed, opt2, grads(resumed, t))
        if t == 3:
            frames = counter.frame_count  # the new optimizer's frames (its state made: compiled at its first step)
    _assert_same(resumed, opt2, whole, whole_opt, "resumed against uninterrupted")
    assert counter.frame_count == frames


@pytest.mark.parametrize("kind,fused", [("sgd", False), ("adamw", True)], ids=["sgd-float32", "adamw-fused"])
def test_a_compiled_train_step_with_backward(kind, fused):
    """backward, step and zero_grad in one compiled function (graph breaks at backward and at the hooks); the
    loss is elementwise, so the gradients are the eager ones bitwise, and so is the step (SGD; fused AdamW's
    keyed parameters, stepped outside the graph: the model is all low-precision)."""
    targets = {fqn: keyinit.random.normal(keyinit.key_for(keyinit.key(5), fqn), p.shape)
               for fqn, p in _model().named_parameters()}
    runs = []
    for compile_it in (False, True):
        model, opt, sr = _setup(kind, fused)
        if fused:
            model["n"].to(torch.bfloat16)

        def train_step():
            loss = sum(((p.float() - targets[fqn]) ** 2).sum() for fqn, p in model.named_parameters())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        counter = CompileCounterWithBackend("aot_eager")
        step = torch.compile(train_step, backend=counter) if compile_it else train_step
        frames = []
        for t in range(STEPS):
            with torch._dynamo.config.patch(error_on_recompile=t >= 2):
                step()
            frames.append(counter.frame_count)
        if compile_it:
            assert frames[1] == frames[-1] >= 1, frames
        runs.append((model, opt))
    _assert_same(*runs[1], *runs[0], "compiled train step against eager")


@pytest.mark.parametrize("fused", [False, True], ids=["float32", "fused"])
def test_an_lr_scheduler_does_not_recompile(fused):
    """A scheduler changing the lr between compiled steps: still compiled in the first two steps only, and the
    reference's values (run with the scheduler). AdamW takes a Python-float lr (fused=True needs one); SGD a tensor
    lr (torch's compiled SGD, keyed or not, recompiles for every new Python-float lr)."""
    def make(params):
        return (torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1) if fused else
                torch.optim.SGD(params, lr=torch.tensor(0.1), momentum=0.9))

    def lambda_lr(t):
        return 1 / (t + 1)

    runs = []
    for compile_it in (False, True):
        model = _model()
        opt = make(model.parameters())
        sr = stochastic_rounding(opt, SEED, names=model, fused=fused)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda_lr)
        counter = CompileCounterWithBackend("aot_eager")
        step = torch.compile(opt.step, backend=counter) if compile_it else opt.step
        frames = []
        for t in range(STEPS):
            _grads(model, t)
            with torch._dynamo.config.patch(error_on_recompile=t >= 2):
                step()
            schedule.step()
            frames.append(counter.frame_count)
        assert sr.step == STEPS
        runs.append(dict(model.named_parameters()))
    assert frames[1] == frames[-1] >= 1, frames
    eager, compiled = runs
    ref = dict(_reference("", fused, "aot_eager", make=make, lambda_lr=lambda_lr)[0].named_parameters())
    for fqn, p in compiled.items():
        # the fused step (outside the graph) is the eager one; the float32 path is the reference's
        want = eager[fqn] if fused and p.dtype != torch.float32 else ref[fqn]
        assert torch.equal(p.detach(), want.detach().to(p.dtype)), fqn


def test_fullgraph_is_refused_with_the_reason():
    model, opt, sr = _setup("sgd", False)
    _grads(model, 0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match=r"(?s)stochastic_rounding's step hooks .* run eagerly between the compiled parts of "
                             r"optimizer.step\(\); compile the step without fullgraph=True"):
        torch.compile(opt.step, backend="eager", fullgraph=True)()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert sr.step == 0 and all(any(p is q for q in model.parameters()) for g in opt.param_groups for p in g["params"])


class FailingAdamW(torch.optim.AdamW):
    fail = False

    def step(self, closure=None):
        result = super().step(closure)
        if self.fail:
            raise RuntimeError("step failed")
        return result


def test_a_compiled_step_that_raises_puts_everything_back():
    model = _model()
    opt = FailingAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sr = stochastic_rounding(opt, SEED, names=model)
    step = torch.compile(opt.step, backend="aot_eager")
    for t in range(3):
        _grads(model, t)
        if t == 1:
            before = [p.detach().clone() for p in model.parameters()]
            opt.fail = True
            with pytest.raises(RuntimeError, match="step failed"):
                step()
            opt.fail = False
            assert sr.step == 1 and all(p in opt.state for p in model.parameters())
            assert all(any(p is q for q in model.parameters()) for g in opt.param_groups for p in g["params"])
            _assert_nothing_held(model, opt, sr)
            # the keyed parameters are not rounded (torch's step updated the float32 one in place, as always)
            for (fqn, p), b in zip(model.named_parameters(), before):
                assert p.dtype == torch.float32 or torch.equal(p.detach(), b), fqn
            _grads(model, t)
            step()  # the next step runs with the same counter
            assert sr.step == 2
            break
        step()


def _fsdp2_compiled_run(steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model()
    for name in ("a", "b", "n"):  # (the root, a ModuleDict, has no forward to shard around)
        fully_shard(model[name], mesh=mesh)
    opt = OPTIMIZERS["sgd"](model.parameters())
    sr = stochastic_rounding(opt, SEED, names=model)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(opt.step, backend=counter)
    frames = []
    for t in range(steps):
        for fqn, p in model.named_parameters():  # the keyed gradients of _grads, sharded as the parameter
            k = keyinit.key_for(keyinit.fold_in(keyinit.key(99), t), fqn)
            p.grad = distribute_tensor(keyinit.random.normal(k, p.shape, std=0.3, dtype=p.dtype), mesh, p.placements)
        with torch._dynamo.config.patch(error_on_recompile=t >= 2):
            step()
        frames.append(counter.frame_count)
    return {fqn: p.full_tensor() for fqn, p in model.named_parameters()}, frames, sr.step


@pytest.mark.slow  # two processes, each compiling: ~10 s on 2 cores
@requires_gloo
def test_fsdp2_two_ranks_compiled_match_one_process_eager():
    """DTensor parameters (FSDP2, 2 gloo ranks): the compiled step (SGD, aot_eager) compiles in the first two steps
    only and gives one eager process's parameters bitwise."""
    ref_model, _ = _eager("sgd", False)
    expected = dict(ref_model.named_parameters())
    for rank, (state, frames, step) in enumerate(run_distributed(_fsdp2_compiled_run, 2, args=(STEPS,), timeout=240)):
        assert step == STEPS and frames[1] == frames[-1] >= 1, (rank, frames)
        for fqn, value in state.items():
            assert value.dtype == expected[fqn].dtype and torch.equal(value, expected[fqn].detach()), (rank, fqn)

