"""keyinit.nn.compile: a compiled keyed call changes what one eager keyed call changes, once (issue 34).

Buffers (BatchNorm's running statistics, a counter written in place, a reassigned buffer) and inputs
written in place end each call as after one eager keyed call, also on the first call of a new graph (whose
trace runs the graph for real) and when a call is undone (run again eagerly) or refused. Also: options
reach the inner backend, RReLU's slopes, state_dict names, index="dim0", and direct calls of a compiled
model's submodules inside keyed.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError
from tests.nn.compile.test_keyed_compile import _fresh_dynamo, kernel_masks  # noqa: F401 - (_fresh_dynamo: autouse fixture)


def _x(rows: int = 6, dim: int = 4) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))


def _twins(make):
    """Two models with the same parameters and buffers (without reading torch's global generator)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        a = make().train()
        b = make().train()
    b.load_state_dict(a.state_dict())
    return a, b


def _buffers_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = dict(a.named_buffers()), dict(b.named_buffers())
    assert sa.keys() == sb.keys()
    for name in sa:
        if sa[name].is_floating_point():
            torch.testing.assert_close(sa[name], sb[name], rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(sa[name], sb[name]), (name, sa[name], sb[name])


class Effects(nn.Module):
    """BatchNorm, a counter written in place, a reassigned counter, dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("written", torch.zeros(()))
        self.register_buffer("reassigned", torch.zeros(()))

    def forward(self, x):
        self.written.add_(1)
        self.reassigned = self.reassigned + 1
        return self.drop(self.bn(self.lin(x))) + self.written + self.reassigned


def _run(model, forward, steps=3, x=None):
    outs = []
    for step in range(steps):
        with knn.keyed(model, 0, step=step):
            outs.append(forward(_x() if x is None else x).detach())
    return outs


def test_a_new_graph_writes_buffers_once():
    eager, plain = _twins(Effects)
    compiled = knn.compile(plain, backend="aot_eager")
    expected = _run(eager, eager)
    got = _run(compiled, compiled)
    assert plain.bn.num_batches_tracked.item() == eager.bn.num_batches_tracked.item() == 3
    assert plain.written.item() == plain.reassigned.item() == 3.0
    _buffers_equal(plain, eager)
    for a, b in zip(got, expected):  # the first call (a new trace) included
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_input_normalised_in_place_is_written_once():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            x.sub_(x.mean(0)).div_(2)
            return F.dropout(self.lin(x), 0.3, self.training)

    eager, plain = _twins(InPlace)
    compiled = knn.compile(plain, backend="aot_eager")
    for step in range(2):
        xe, xc = _x(), _x()
        with knn.keyed(eager, 0, step=step):
            ye = eager(xe)
        with knn.keyed(compiled, 0, step=step):
            yc = compiled(xc)
        torch.testing.assert_close(xc, xe, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-6)
        assert torch.equal(yc == 0, ye == 0)


class LayerDrop(nn.Module):
    """A draw dynamo runs eagerly (a graph break on it): the first call is undone and run again eagerly."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2)) for _ in range(2)])
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("count", torch.zeros(()))
        self.calls = 0

    def forward(self, x):
        self.count = self.count + 1  # reassigned: dynamo sets the new tensor after its graph
        self.calls += 1
        x = self.norm(x) + self.count
        for layer in self.layers:
            if torch.rand([]) < 0.5:
                continue
            x = layer(x)
        return x


def test_an_undone_call_puts_back_reassigned_buffers_and_attributes():
    eager, plain = _twins(LayerDrop)
    compiled = knn.compile(plain, backend="aot_eager")
    for step in range(3):
        with knn.keyed(eager, 0, step=step):
            ye = eager(_x())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with knn.keyed(compiled, 0, step=step):
                yc = compiled(_x())
        assert torch.equal(yc, ye)
        assert plain.count.item() == eager.count.item() == step + 1
        assert plain.calls == eager.calls == step + 1
        _buffers_equal(plain, eager)
    assert compiled.runs_eagerly


def test_outside_keyed_a_training_call_is_refused_with_nothing_changed():
    class Broken(nn.Module):  # a graph break between the BatchNorm's graph and the dropout's
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count.add_(1)
            x = self.bn(x)
            torch._dynamo.graph_break()
            return F.dropout(x, 0.5, self.training)

    for make in (Broken, Effects):
        model = make().train()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        compiled = knn.compile(model, backend="aot_eager")
        x = _x()
        state = torch.get_rng_state()
        for _ in range(2):
            with pytest.raises(UnkeyedRandomnessError, match="outside keyinit.nn.keyed"):
                compiled(x)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), make
        assert torch.equal(x, _x()) and torch.equal(torch.get_rng_state(), state)


def test_mode_and_options_reach_the_inner_backend():
    model, twin = _twins(lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)))
    x = _x()
    with knn.keyed(twin, 0, step=1):
        expected = twin(x)
    for options in (dict(mode="reduce-overhead"), dict(options={"max_autotune": False})):
        torch._dynamo.reset()
        compiled = knn.compile(model, **options)  # inductor
        with knn.keyed(compiled, 0, step=1):
            out = compiled(x)
        assert torch.equal(out == 0, expected == 0), options
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(compiled.eval()(x), twin.eval()(x), rtol=1e-4, atol=1e-5)
        compiled.train(), twin.train()


def test_bad_options_are_refused_when_compiling():
    with pytest.raises(ValueError, match="mode= and options= cannot both be given"):
        knn.compile(nn.Linear(2, 2), mode="max-autotune", options={"max_autotune": True})
    with pytest.raises(TypeError, match="options= must be a dict"):
        knn.compile(nn.Linear(2, 2), options=["max_autotune"])
    with pytest.raises(RuntimeError, match="not_an_inductor_option"):
        knn.compile(nn.Linear(2, 2), options={"not_an_inductor_option": 1})


def test_rrelu_equals_eager():
    model = nn.RReLU(0.1, 0.4).train()
    compiled = knn.compile(nn.Sequential(model), backend="aot_eager")
    eager = nn.Sequential(model)
    x = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(2))
    for step, offset in [(0, 0), (1, 0), (2, 3)]:
        with knn.keyed(eager, 0, step=step, sample_offset=offset):
            expected = eager(x)
        with knn.keyed(compiled, 0, step=step, sample_offset=offset):
            got = compiled(x)
        assert torch.equal(got, expected), (step, offset)
        assert not torch.equal(got, F.rrelu(x, 0.1, 0.4, False))  # slopes were drawn (not the eval slope)


def test_state_dict_names_are_the_plain_models():
    def make():
        return nn.Sequential(nn.Linear(2, 3), nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))

    with torch.random.fork_rng():
        torch.manual_seed(0)
        plain, other = make(), make()
    holder = make()
    holder[1] = knn.compile(holder[1], backend="aot_eager")  # a compiled block
    holder.load_state_dict(plain.state_dict())  # strict: names match
    whole = knn.compile(holder, backend="aot_eager")
    assert list(whole.state_dict()) == list(holder.state_dict()) == list(plain.state_dict())
    result = other.load_state_dict(whole.state_dict(), strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), plain.state_dict().values()))
    assert whole.state_dict()._metadata["1.1"]["version"] == plain.state_dict()._metadata["1.1"]["version"]


def test_index_dim0_is_refused_before_running():
    model = Effects().train()
    compiled = knn.compile(model, backend="aot_eager")
    with pytest.raises(ValueError, match=r"index='dim0'.*not support"):
        with knn.keyed(compiled, 0, step=0, index="dim0"):
            compiled(_x())
    assert model.bn.num_batches_tracked.item() == 0 and model.written.item() == 0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return F.dropout(self.head(self.enc(x)), 0.3, self.training)


def test_a_direct_call_of_a_submodule_inside_keyed_is_keyed_as_under_the_plain_model():
    net = Net().train()
    compiled = knn.compile(net, backend="aot_eager")
    x = _x()
    state = torch.get_rng_state()
    with knn.keyed(net, 0, step=4):
        expected = [net(x), net.enc(x), net(x)]
    with knn.keyed(compiled, 0, step=4):  # compiled, then the submodule directly, then the module itself
        got = [compiled(x), net.enc(x), compiled.module(x)]
    assert torch.equal(got[0] == 0, expected[0] == 0)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])  # eager keyed, both
    assert (got[1] == 0).any() and not torch.equal(got[0] == 0, got[2] == 0)  # a repeat: keyed differently
    assert torch.equal(torch.get_rng_state(), state)


# ----------------------------------------------------------------------------- property


class Random(nn.Module):
    """A small model drawn from ``rng``: some of dropout, BatchNorm, an in-place counter, a reassigned one."""

    def __init__(self, rng: random.Random, checkpointed: bool = False) -> None:
        super().__init__()
        self.parts = [p for p in ("drop", "bn", "written", "reassigned", "fdrop") if rng.random() < 0.6]
        if checkpointed:  # a checkpointed block (linear, dropout) somewhere among the parts
            self.parts.insert(rng.randrange(len(self.parts) + 1), "ckpt")
            self.reentrant = rng.random() < 0.5
            self.block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(rng.choice([0.2, 0.5])))
        if "drop" not in self.parts and "fdrop" not in self.parts:
            self.parts.append("drop")
        rng.shuffle(self.parts)
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4) if "bn" in self.parts else None
        self.drop = nn.Dropout(rng.choice([0.1, 0.5]))
        self.register_buffer("written", torch.zeros(4))
        self.register_buffer("reassigned", torch.zeros(()))

    def forward(self, x):
        x = self.lin(x)
        for part in self.parts:
            if part == "drop":
                x = self.drop(x)
            elif part == "bn":
                x = self.bn(x)
            elif part == "written":
                self.written.add_(x.detach().mean(0))
                x = x + self.written
            elif part == "reassigned":
                self.reassigned = self.reassigned + 1
                x = x * self.reassigned
            elif part == "ckpt":
                x = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)
            else:
                x = F.dropout(x, 0.25, self.training)
        return x


@pytest.mark.parametrize("seed", range(4))
def test_property_compiled_keyed_steps_equal_eager_keyed(seed):
    rng = random.Random(seed)
    state = rng.getstate()
    eager, plain = _twins(lambda: Random(random.Random(seed)))
    assert eager.parts == plain.parts
    compiled = knn.compile(plain, backend="aot_eager")
    rows = rng.choice([3, 6])
    x = _x(rows)
    for step in range(3):
        with kernel_masks() as eager_masks, knn.keyed(eager, seed, step=step):
            ye = eager(x)
        with kernel_masks() as compiled_masks, knn.keyed(compiled, seed, step=step):
            yc = compiled(x)
        assert eager_masks == compiled_masks and eager_masks, (eager.parts, step)
        torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-5)
    _buffers_equal(plain, eager)
    del state


def _grads(model: nn.Module) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _checkpointed_steps(seed: int, backend: str) -> None:
    """A random model with a checkpointed block, trained 3 keyed steps eagerly and under keyinit.nn.compile
    (backward inside the block: the recompute's draws repeat the first execution's): equal masks, outputs,
    gradients and buffers, and torch's generator untouched."""
    eager, plain = _twins(lambda: Random(random.Random(seed), checkpointed=True))
    assert eager.parts == plain.parts and "ckpt" in eager.parts
    compiled = knn.compile(plain, backend=backend)
    x = _x(random.Random(seed).choice([3, 6]))
    state = torch.get_rng_state()
    for step in range(3):
        for model in (eager, plain):
            model.zero_grad(set_to_none=True)
        # (masks recorded in the forwards: the backward's kernel calls mask the gradient, whose zeros are
        # elsewhere; the recompute's draws show in the gradients)
        with knn.keyed(eager, seed, step=step):
            with kernel_masks() as eager_masks:
                ye = eager(x.clone().requires_grad_())
            ye.square().sum().backward()
        with knn.keyed(compiled, seed, step=step):
            with kernel_masks() as compiled_masks:
                yc = compiled(x.clone().requires_grad_())
            yc.square().sum().backward()
        assert eager_masks == compiled_masks and eager_masks, (eager.parts, step)
        torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-5)
        ge, gc = _grads(eager), _grads(plain)
        assert ge.keys() == gc.keys() and ge
        for name in ge:
            torch.testing.assert_close(gc[name], ge[name], rtol=1e-4, atol=1e-5, msg=name)
    _buffers_equal(plain, eager)
    assert torch.equal(torch.get_rng_state(), state)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in plain.modules())  # nothing of keyinit left


@pytest.mark.parametrize("seed", range(4, 8))
def test_property_compiled_checkpointed_keyed_steps_equal_eager_keyed(seed):
    _checkpointed_steps(seed, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("seed,checkpointed", [(8, False), (9, True)])
def test_property_inductor_keyed_steps_equal_eager_keyed(seed, checkpointed):
    """The same property under inductor (its decompositions and fused kernels: outputs with a tolerance, masks
    bitwise), one random model with and one without a checkpointed block."""
    if checkpointed:
        _checkpointed_steps(seed, "inductor")
        return
    eager, plain = _twins(lambda: Random(random.Random(seed)))
    compiled = knn.compile(plain, backend="inductor")
    x = _x(random.Random(seed).choice([3, 6]))
    for step in range(3):
        with kernel_masks() as eager_masks, knn.keyed(eager, seed, step=step):
            ye = eager(x)
        with kernel_masks() as compiled_masks, knn.keyed(compiled, seed, step=step):
            yc = compiled(x)
        assert eager_masks == compiled_masks and eager_masks, (eager.parts, step)
        torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-5)
    _buffers_equal(plain, eager)
