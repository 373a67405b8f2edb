"""Hostile and careless input (issue 14): a clear error before anything is written, or the right values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import keyinit
from keyinit import init
from keyinit.errors import PlanError
from keyinit.layouts import ManualShard


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_unchanged(before: dict[str, torch.Tensor], model: nn.Module) -> None:
    after = model.state_dict()
    assert list(after) == list(before)
    for name, value in after.items():
        assert value.shape == before[name].shape and torch.equal(value, before[name]), name


class Tied(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, 4)
        self.head = nn.Linear(4, rows, bias=False)
        self.head.weight = self.emb.weight


# ---------------------------------------------------------------- shards= names


def test_a_shard_under_a_misspelt_fqn_is_a_plan_error_naming_the_closest_fqn():
    model = nn.Sequential(nn.Linear(4, 4))
    before = snapshot(model)
    with pytest.raises(PlanError, match=r"'0\.weigth' \(did you mean '0\.weight'\?\)") as info:
        keyinit.init_model(model, 0, shards={"0.weigth": ManualShard((8, 4), (slice(4, 8), slice(None)))})
    assert info.value.fqns == ("0.weigth",)
    assert_unchanged(before, model)


def test_a_shard_naming_no_tensor_is_allowed_only_when_not_strict():
    model = nn.Linear(4, 4)
    shard = ManualShard((8, 4), (slice(0, 4), slice(None)))
    with pytest.raises(PlanError, match="shards names no tensor"):
        keyinit.init_model(model, 0, shards={"layers.9.weight": shard})
    keyinit.init_model(model, 0, shards={"layers.9.weight": shard}, strict=False)
    full = nn.Linear(4, 4)
    keyinit.init_model(full, 0)
    assert torch.equal(model.weight, full.weight)


def test_a_shard_declared_under_the_second_name_of_a_tied_weight_applies_to_the_tensor():
    full = Tied(8)
    keyinit.init_model(full, 0)
    stage = Tied(4)
    keyinit.init_model(stage, 0, shards={"head.weight": ManualShard((8, 4), (slice(4, 8), slice(None)))})
    assert torch.equal(stage.emb.weight, full.emb.weight[4:])
    assert stage.head.weight is stage.emb.weight


def test_different_shards_under_two_names_of_one_tensor_are_refused():
    stage = Tied(4)
    with pytest.raises(PlanError, match="two names of one tied tensor"):
        keyinit.init_model(stage, 0, shards={"head.weight": ManualShard((8, 4), (slice(4, 8), slice(None))),
                                             "emb.weight": ManualShard((8, 4), (slice(0, 4), slice(None)))})


# ---------------------------------------------------------------- ties=


@pytest.mark.parametrize("ties, message", [
    ({"0.weight": "1.weight", "1.weight": "0.weight"}, r"ties form a cycle: '0\.weight' -> '1\.weight' -> '0\.weight'"),
    ({"0.weight": "1.weight", "1.weight": "2.weight"}, r"ties form a chain"),
    ({"0.bias": "1.weight"}, r"tie '0\.bias' -> '1\.weight' joins tensors of different global shapes \(4,\) and \(4, 4\)"),
])
def test_bad_ties_are_plan_errors(ties, message):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    before = snapshot(model)
    with pytest.raises(PlanError, match=message):
        keyinit.init_model(model, 0, ties=ties, strict=False)
    assert_unchanged(before, model)


def test_a_tie_between_equal_shapes_still_keys_the_alias_by_its_target():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    keyinit.init_model(model, 0, ties={"1.weight": "0.weight"})
    assert torch.equal(model[0].weight, model[1].weight)


# ---------------------------------------------------------------- rules that are not initializers


@pytest.mark.parametrize("fn", [nn.init.zeros_, nn.init.normal_, nn.init.xavier_uniform_])
def test_a_torch_nn_init_function_as_a_rule_is_a_plan_error_before_any_write(fn):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    before = snapshot(model)
    name = fn.__name__
    with pytest.raises(PlanError, match=rf"'2\.weight': torch\.nn\.init\.{name} takes a tensor.*keyinit\.init\."):
        keyinit.init_model(model, 0, rules={"2.weight": fn})
    assert_unchanged(before, model)


def test_a_callable_of_the_wrong_signature_is_a_plan_error():
    model = nn.Linear(4, 4)
    with pytest.raises(PlanError, match=r"must be an initializer called as fn\(key, target\)"):
        keyinit.init_model(model, 0, rules={"weight": lambda tensor: None})
    with pytest.raises(PlanError, match=r"rule Linear for weight: .* must be an initializer"):
        keyinit.init_model(model, 0, rules={nn.Linear: lambda m, ctx: {"weight": lambda t: None}})


def test_register_pattern_refuses_a_torch_nn_init_function():
    registry = keyinit.Registry()
    with pytest.raises(TypeError, match=r"torch\.nn\.init\.zeros_ takes a tensor"):
        registry.register_pattern("*.weight", nn.init.zeros_)


def test_a_custom_initializer_raising_in_the_dry_run_is_a_plan_error_naming_the_tensor():
    class Boom(init.Initializer):
        def __call__(self, key, target):
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    before = snapshot(model)
    with pytest.raises(PlanError, match=r"^1\.weight: RuntimeError: boom") as info:
        keyinit.init_model(model, 0, rules={"1.weight": Boom()})
    assert info.value.fqns == ("1.weight",)
    assert_unchanged(before, model)


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("function", [keyinit.init_model, keyinit.materialize, keyinit.plan_init])
def test_a_non_module_is_a_type_error_naming_the_function_called(function):
    with pytest.raises(TypeError, match=f"^{function.__name__} expects an nn.Module, got dict"):
        function({"weight": torch.zeros(2)}, 0)


@pytest.mark.parametrize("seed", [torch.tensor(True), np.True_, True, 1.0, "1"])
def test_booleans_and_non_integers_are_refused_as_seeds(seed):
    with pytest.raises(TypeError, match="seed must be an int"):
        keyinit.key(seed)


def test_integer_scalars_key_accepts_are_accepted_everywhere():
    k = keyinit.key(np.int64(3))
    assert k == keyinit.key(torch.tensor(3)) == keyinit.key(3)
    assert keyinit.split(k, np.int64(3)) == keyinit.split(k, 3)
    expected = keyinit.random.randint(k, (16,), low=-2, high=9)
    assert torch.equal(keyinit.random.randint(k, (16,), low=np.int32(-2), high=np.int64(9)), expected)
    assert torch.equal(keyinit.random.randint(k, (16,), low=torch.tensor(-2), high=9), expected)
    with pytest.raises(ValueError, match="num must be a non-negative int"):
        keyinit.split(k, np.True_)
    shape = (np.int64(3), np.int32(2), torch.tensor(2))  # as torch takes shapes
    assert torch.equal(keyinit.random.normal(k, shape), keyinit.random.normal(k, (3, 2, 2)))
    for bad in (np.True_, True, torch.tensor(True), 2.0, np.float32(2)):
        with pytest.raises(TypeError, match="shape must be a tuple of ints"):
            keyinit.random.normal(k, (3, bad))


# ---------------------------------------------------------------- keyinit verify


@pytest.mark.parametrize("body, message", [
    ("def f():\n    raise SystemExit(0)\n", "f() called sys.exit(0) instead of returning a model; nothing was checked"),
    ("import sys\nsys.exit(0)\ndef f():\n    pass\n", "called exit(0); nothing was checked"),
])
def test_verify_with_a_factory_that_exits_fails_with_exit_code_2(capsys, tmp_path, body, message):
    from keyinit.cli import main

    path = tmp_path / "exiting.py"
    path.write_text(body)
    code = main(["verify", f"{path}:f", "--layouts", "fsdp2"])
    _, err = capsys.readouterr()
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- nothing half-written


class Recreating(nn.Module):
    """Init code that re-creates ``a.weight`` with a new shape and registers new tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def init_weights(self) -> None:
        self.a.weight = nn.Parameter(torch.zeros(5, 3))
        self.register_buffer("table", torch.arange(4.0))
        self.extra = nn.Parameter(torch.ones(2))


def _fail_writing(monkeypatch, fqn, error=RuntimeError):
    from keyinit._engine.planning.planned import ModelPlan

    original = ModelPlan.write

    def write(self, tensor, target):
        if tensor.fqn == fqn:
            raise error(f"simulated failure writing {fqn}")
        original(self, tensor, target)

    monkeypatch.setattr(ModelPlan, "write", write)


@pytest.mark.parametrize("failing", ["a.weight", "table", "extra"])
def test_a_failed_write_of_a_re_created_or_new_tensor_puts_the_module_back(monkeypatch, failing):
    model = Recreating()
    before = snapshot(model)
    weight = model.a.weight
    _fail_writing(monkeypatch, failing)
    with pytest.raises(keyinit.InitError, match=f"simulated failure writing {failing}") as info:
        keyinit.init_model(model, 0, init_method="init_weights", rules={"b.*": init.zeros()})
    assert failing not in info.value.written
    if failing == "a.weight":
        assert model.a.weight is weight and torch.equal(model.a.weight, before["a.weight"])
    assert not hasattr(model, failing) if failing != "a.weight" else True
    state = model.state_dict()
    for name in info.value.written:  # exactly what InitError.written says, and nothing else
        assert name in state
    for name, value in before.items():
        if name not in info.value.written:
            assert torch.equal(state[name], value), name


def test_an_initializer_failing_part_way_leaves_its_tensor_as_it_was():
    def half(key, target):
        target.out[:1].fill_(123.0)
        raise RuntimeError("failed after one row")

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    before = snapshot(model)
    with pytest.raises(keyinit.InitError, match="failed after one row") as info:
        keyinit.init_model(model, 0, rules={"1.weight": half})
    assert "1.weight" not in info.value.written
    assert torch.equal(model[1].weight, before["1.weight"])
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items() if k not in info.value.written)


@pytest.mark.parametrize("failing", ["b.weight", "a.weight", "extra"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_materialize_leaves_the_models_own_tensors_on_meta(monkeypatch, failing, error):
    with torch.device("meta"):
        model = Recreating()
    keys = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    _fail_writing(monkeypatch, failing, error)
    with pytest.raises(keyinit.InitError if error is RuntimeError else error):
        keyinit.materialize(model, 0, device="cpu", init_method="init_weights", rules={"b.*": init.zeros()})
    assert {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()} == keys
    assert all(t.is_meta for t in model.state_dict().values())
    assert not hasattr(model, "extra") and not hasattr(model, "table")


# ---------------------------------------------------------------- module rules may not write while planning


@pytest.mark.parametrize("body, message", [
    (lambda m, model: nn.init.normal_(m.weight), r"writes 0\.weight \(normal_"),
    (lambda m, model: m.weight.data.zero_(), r"writes 0\.weight \(zero_"),
    (lambda m, model: m.bias.data.copy_(torch.ones(4)), r"writes 0\.bias \(copy_"),
    (lambda m, model: model[1].weight.data.fill_(5.0), r"rule Linear for 0 writes 1\.weight \(fill_"),
    (lambda m, model: setattr(m, "weight", nn.Parameter(torch.zeros(4, 4))), r"re-assigned \['weight'\]"),
    (lambda m, model: model[1].register_buffer("late", torch.ones(1)), r"a module rule re-assigned \['late'\]"),
    (lambda m, model: setattr(model[1].weight, "data", torch.ones(4, 4)), r"a module rule changed the data.* \['1\.weight'\]"),
    (lambda m, model: m.add_module("extra", nn.Identity()), r"re-assigned \['extra'\]"),
    (lambda m, model: setattr(m.weight, "data", torch.zeros(2, 4)), r"changed the data.* of \['0\.weight'\]"),
    (lambda m, model: m.double(), r"changed the data, dtype.* of \['0\.weight', '0\.bias'\]"),
    (lambda m, model: m.to_empty(device="cpu"), r"changed the data.* of \['0\.weight', '0\.bias'\]"),
    (lambda m, model: m.weight.requires_grad_(False), r"requires_grad of \['0\.weight'\]"),
])
@pytest.mark.parametrize("then_fails", [False, True])
def test_a_module_rule_that_writes_while_planning_is_refused_and_the_model_kept(body, message, then_fails):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    before = snapshot(model)
    parameters = list(model.parameters())
    rng = torch.random.get_rng_state()

    def rule(module, ctx):
        if module is model[0]:
            body(module, model)
            if then_fails:  # the rule's own error, after the change: the change is put back all the same
                raise ValueError("the rule gave up")
        return {"weight": init.zeros()}

    with pytest.raises(PlanError, match=f"{message}|the rule gave up" if then_fails else message):
        keyinit.init_model(model, 0, rules={nn.Linear: rule})
    assert_unchanged(before, model)
    assert list(model.parameters()) == parameters and list(model.modules()) == [model, model[0], model[1]]
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)


# ---------------------------------------------------------------- one draw in tensors a pipeline cut separates


class SharedDraw(nn.Module):
    def __init__(self, layers=(0, 1), fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.layers = nn.ModuleDict({str(i): nn.Module() for i in layers})
        for layer in self.layers.values():
            layer.q, layer.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def init_weights(self) -> None:
        shared = torch.randn(4, 4)
        for layer in self.layers.values():
            if self.fused:  # one draw per layer, split into q and k: stays on one stage
                qk = torch.randn(8, 4)
                layer.q.weight.copy_(qk[:4])
                layer.k.weight.copy_(qk[4:])
            else:
                layer.q.weight.copy_(shared)
                layer.k.weight.normal_()
            layer.q.bias.zero_()
            layer.k.bias.zero_()


def test_a_draw_shared_across_pipeline_units_warns_naming_the_tensors():
    full = SharedDraw()
    with pytest.warns(keyinit.SharedDrawWarning, match=r"\['layers\.0\.q\.weight', 'layers\.1\.q\.weight'\].*keyed by "
                                                       r"'layers\.0\.q\.weight'"):
        keyinit.init_model(full, 0, init_method="init_weights")
    # what the warning is about: the stage without layers.0 cannot reproduce layers.1.q.weight
    stage = SharedDraw(layers=(1,))
    keyinit.init_model(stage, 0, init_method="init_weights")
    assert not torch.equal(stage.layers["1"].q.weight, full.layers["1"].q.weight)
    assert torch.equal(stage.layers["1"].k.weight, full.layers["1"].k.weight)


def test_a_draw_shared_within_one_list_item_is_layout_invariant_and_silent():
    import warnings

    full = SharedDraw(fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", keyinit.SharedDrawWarning)
        keyinit.init_model(full, 0, init_method="init_weights")
    stage = SharedDraw(layers=(1,), fused=True)
    keyinit.init_model(stage, 0, init_method="init_weights")
    assert torch.equal(stage.layers["1"].q.weight, full.layers["1"].q.weight)
    assert torch.equal(stage.layers["1"].k.weight, full.layers["1"].k.weight)


# ---------------------------------------------------------------- init code: orthogonal_, in-place view ops


class Orthogonal(nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(*shape))

    def reset_parameters(self) -> None:
        nn.init.orthogonal_(self.w, gain=2.0)


@pytest.mark.parametrize("shape", [(3, 8), (8, 3), (2, 3, 4), (6, 2, 2), (1, 5)])
def test_nn_init_orthogonal_in_init_code_equals_keyinits_orthogonal_for_any_shape(shape):
    code = Orthogonal(*shape)
    keyinit.init_model(code, 0)
    rule = Orthogonal(*shape)
    keyinit.init_model(rule, 0, rules={"w": init.orthogonal(gain=2.0)})
    assert torch.equal(code.w, rule.w)
    rows = shape[0]
    flat = code.w.detach().reshape(rows, -1)
    gram = flat @ flat.T if rows <= flat.shape[1] else flat.T @ flat
    assert torch.allclose(gram, 4 * torch.eye(gram.shape[0]), atol=1e-4)


_INPLACE_VIEWS = [
    ("t_", lambda t: t.t_(), lambda t: t.t(), (4, 6)),
    ("transpose_", lambda t: t.transpose_(0, 1), lambda t: t.transpose(0, 1), (4, 6)),
    ("swapdims_", lambda t: t.swapdims_(0, 1), lambda t: t.swapdims(0, 1), (4, 6)),
    ("unsqueeze_", lambda t: t.unsqueeze_(0), lambda t: t.unsqueeze(0), (6, 4)),
    ("squeeze_", lambda t: t.squeeze_(), lambda t: t.squeeze(), (1, 6, 4)),
    ("as_strided_", lambda t: t.as_strided_((6, 4), (1, 6)), lambda t: t.as_strided((6, 4), (1, 6)), (4, 6)),
]


class ViewsInPlace(nn.Module):
    def __init__(self, view, shape, random: bool) -> None:
        super().__init__()
        self.view, self.shape, self.random = view, shape, random
        self.w = nn.Parameter(torch.empty(6, 4))

    def reset_parameters(self) -> None:
        n = 24
        t = torch.randn(self.shape) if self.random else torch.arange(float(n)).reshape(self.shape)
        t = self.view(t) if self.view is not None else t
        with torch.no_grad():
            self.w.copy_(t.reshape(6, 4))


@pytest.mark.parametrize("name, inplace, outofplace, shape", _INPLACE_VIEWS, ids=[v[0] for v in _INPLACE_VIEWS])
def test_in_place_view_ops_on_temporaries_are_captured(name, inplace, outofplace, shape):
    model = ViewsInPlace(inplace, shape, random=False)
    keyinit.init_model(model, 0)
    expected = outofplace(torch.arange(24.0).reshape(shape)).reshape(6, 4)
    assert torch.equal(model.w, expected)
    drawn, reference = ViewsInPlace(inplace, shape, True), ViewsInPlace(outofplace, shape, True)
    keyinit.init_model(drawn, 0)
    keyinit.init_model(reference, 0)
    assert torch.equal(drawn.w, reference.w)
    rows = ViewsInPlace(inplace, shape, True)  # a manual shard of rows gets the same rows
    rows.w = nn.Parameter(torch.empty(2, 4))
    keyinit.init_model(rows, 0, shards={"w": ManualShard((6, 4), (slice(2, 4), slice(None)))})
    assert torch.equal(rows.w, drawn.w[2:4])


def test_an_in_place_view_op_on_a_model_tensor_is_a_clear_plan_error():
    class Transposes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(2, 3))

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.w.t_()

    model = Transposes()
    before = snapshot(model)
    with pytest.raises(PlanError, match=r"t_ changes the shape of w in place"):
        keyinit.init_model(model, 0)
    assert_unchanged(before, model)


def test_a_keyinit_initializer_stopped_part_way_is_named_as_possibly_partly_written(monkeypatch):
    """Tensors filled by keyinit initializers are not copied first (planning checked them); if an
    interrupt or out-of-memory stops one anyway, the InitError names it."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    _fail_writing(monkeypatch, "1.weight", torch.OutOfMemoryError)
    with pytest.raises(keyinit.InitError, match=r"1\.weight may be partly written; every other tensor is unchanged"):
        keyinit.init_model(model, 0)


def test_an_initializer_of_the_users_own_that_draws_from_torchs_rng_is_refused_before_any_write():
    """An Initializer calling torch.randn would give unkeyed values (different per layout) and advance
    the global RNG: refused by its plan-time dry run, naming the tensor, model and RNG untouched."""

    class Noisy(keyinit.init.Initializer):
        def __call__(self, key, target):
            target.out.copy_(torch.randn(target.out.shape) * 0.02)

    class NoisyInPlace(keyinit.init.Initializer):
        def __call__(self, key, target):
            target.out.normal_(0.0, 0.02)

    for rule in (Noisy(), NoisyInPlace()):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        rng = torch.get_rng_state()
        with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"^1\.weight: the initializer .* aten\.(randn|normal)"):
            keyinit.init_model(model, 0, rules={"1.weight": rule})
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_rule_function_that_draws_from_torchs_rng_is_refused_when_it_writes():
    """A plain fn(key, target) runs once, when writing (it may keep state, so it gets no dry run): a
    draw from torch's RNG there is refused before it runs, naming the tensor; the failing tensor is
    put back, InitError.written says what was written, the RNG is untouched."""

    def late(key, target):
        if target.out.numel():
            target.out.uniform_()
        else:
            target.out.zero_()

    model = nn.Sequential(nn.Linear(4, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(keyinit.InitError) as raised:
        keyinit.init_model(model, 0, rules={"0.weight": late})
    assert isinstance(raised.value.__cause__, keyinit.UnkeyedRandomnessError)
    assert "0.weight: the initializer" in str(raised.value) and "aten.uniform_" in str(raised.value)
    assert raised.value.written == ("0.bias",)  # written before it, as InitError.written says
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model.state_dict()["0.weight"], before["0.weight"])
