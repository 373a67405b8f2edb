"""``keyinit.deferred``: what a constructor does, recorded and replayed keyed (issue 13).

Each test states a promise: keyed values bitwise (a whole-tensor draw keeps
``key_for(seed, fqn)``, other draws ``fold_in`` of the tensor they land in), deterministic
values bit-identical to eager torch, the precedence (rules > init_method on top of the record >
never a torch.nn default over a record), records surviving what users do between
construction and materialize, and errors at plan time.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import keyinit
from keyinit import init
from keyinit.layouts import ManualShard
from tests.zoo.test_zoo import assert_same_bits, full_state, same_bits

SEED = 7


def _sinusoids(length: int, channels: int) -> torch.Tensor:
    scale = math.log(10000) / (channels // 2 - 1)
    inv = torch.exp(-scale * torch.arange(channels // 2))
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class Patterns(nn.Module):
    """The things constructors do (torchvision, timm, open_clip, research code)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(0.5 * torch.randn(6, 4))  # open_clip: scale * torch.randn
        self.ls = nn.Parameter(1e-2 * torch.ones(5))  # ConvNeXt layer scale
        self.register_buffer("mask", torch.empty(4, 4).fill_(float("-inf")).triu_(1))  # open_clip attn_mask
        self.register_buffer("pos", _sinusoids(8, 6), persistent=False)
        discarded = nn.Linear(3, 3)  # built and thrown away: its draws land nowhere
        del discarded
        self.q = nn.Parameter(torch.empty(4, 4))
        self.q.data.copy_(torch.eye(4) * 2)  # copy_ from a temporary
        self.w = nn.Parameter(torch.zeros(6, 3))
        self.w.data[1:3].fill_(7.0)  # in-place through a view
        self.v = nn.Parameter(torch.empty(8, 2))  # written in pieces, never whole
        self.v.data[:4].normal_()
        self.v.data[4:].zero_()
        self.cls = nn.Parameter(torch.empty(1, 1, 6))
        self.pos_embed = nn.Parameter(torch.empty(1, 5, 6))
        self.lin = nn.Linear(6, 4)
        self.init_parameters()  # timm / open_clip: init at the end of __init__

    def init_parameters(self) -> None:
        nn.init.normal_(self.cls, std=1e-6)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.zeros_(self.lin.bias)


def _fill(initializer, key, shape):
    from keyinit.layouts import Target
    from keyinit.regions import make_region

    out = torch.empty(shape)
    initializer(key, Target("t", make_region(shape, None), out))
    return out


def _deferred_values(builder=Patterns, seed=SEED, **kwargs):
    model = keyinit.deferred(builder)
    report = keyinit.materialize(model, seed, device="cpu", **kwargs)
    return model, report


def test_deferred_leaves_every_tensor_on_meta_and_the_global_rng_untouched():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    model = keyinit.deferred(Patterns)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    assert isinstance(model.p, nn.Parameter) and model.p.requires_grad
    assert "pos" in model._non_persistent_buffers_set
    keyinit.materialize(model, SEED, device="cpu")
    assert torch.equal(torch.get_rng_state(), before)


def test_whole_tensor_draws_give_exactly_the_default_rules_values():
    """A whole-tensor draw keeps key_for(seed, fqn): nn layers built with deferred equal keyinit's defaults."""
    def build():
        return nn.Sequential(nn.Linear(16, 33), nn.LayerNorm(33), nn.Embedding(11, 33, padding_idx=4),
                             nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5))

    deferred_model, report = _deferred_values(build)
    assert {r.source for r in report.records} == {"constructor"}
    eager = build()
    defaults = keyinit.init_model(eager, SEED)
    assert set(defaults.defaults) == set(full_state(eager))
    assert_same_bits(full_state(deferred_model), full_state(eager), "deferred vs default rules")


def test_constructor_patterns_follow_eager_and_are_keyed_where_they_land():
    model, report = _deferred_values()
    eager = Patterns()
    for name in ("ls", "mask", "pos", "q", "w", "lin.bias"):
        assert same_bits(model.get_parameter(name) if "mask" not in name and "pos" not in name
                         else model.get_buffer(name), eager.get_parameter(name) if "mask" not in name
                         and "pos" not in name else eager.get_buffer(name)), name
    root = keyinit.key(SEED)
    k = lambda fqn: keyinit.key_for(root, fqn)  # noqa: E731
    # a temporary draw, scaled: keyed by the tensor it lands in, position 0
    assert same_bits(model.p.detach(), 0.5 * keyinit.random.normal(keyinit.fold_in(k("p"), 0), (6, 4)))
    # whole-tensor fills: the tensor's own key
    assert same_bits(model.cls.detach(), keyinit.random.normal(k("cls"), (1, 1, 6), std=1e-6))
    assert same_bits(model.pos_embed.detach(), _fill(init.truncated_normal(std=0.02), k("pos_embed"), (1, 5, 6)))
    assert same_bits(model.lin.weight.detach(), _fill(init.kaiming_uniform(a=math.sqrt(5)), k("lin.weight"), (4, 6)))
    # pieces: the first half a keyed draw, the rest exactly zero
    assert same_bits(model.v.detach()[4:], torch.zeros(4, 2))
    assert same_bits(model.v.detach()[:4], keyinit.random.normal(keyinit.fold_in(k("v"), 0), (4, 2)))
    assert report.defaults == ()


def test_values_do_not_depend_on_the_global_seed():
    torch.manual_seed(1)
    a, _ = _deferred_values()
    torch.manual_seed(2)
    b, _ = _deferred_values()
    assert_same_bits(full_state(a), full_state(b), "manual_seed 1 vs 2")


def test_pieces_replay_per_manual_shard():
    """A tensor written only in pieces (no whole write first) replays for any region."""
    full, _ = _deferred_values()
    for rows in (slice(0, 3), slice(3, 6), slice(5, 8)):
        model = keyinit.deferred(Patterns)
        model.v = nn.Parameter(torch.empty(rows.stop - rows.start, 2, device="meta"))
        keyinit.materialize(model, SEED, device="cpu", shards={"v": ManualShard((8, 2), (rows, slice(None)))})
        assert same_bits(model.v.detach(), full.v.detach()[rows]), rows


def test_pieces_in_init_code_work_too():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.v = nn.Parameter(torch.empty(8, 2))

        def init_weights(self):
            self.v.data[:4].normal_()
            self.v.data[4:].zero_()

    with torch.device("meta"):
        model = M()
    keyinit.materialize(model, SEED, device="cpu", init_method="init_weights")
    reference, _ = _deferred_values()
    assert same_bits(model.v.detach(), reference.v.detach())


# ----------------------------------------------------------------------------- precedence
def test_rules_win_over_the_record():
    model, report = _deferred_values(rules={"p": init.zeros(), nn.Linear: lambda m, ctx: {"weight": init.ones()}})
    assert torch.count_nonzero(model.p) == 0
    assert torch.all(model.lin.weight == 1)
    assert same_bits(model.lin.bias.detach(), torch.zeros(4))  # the record, where the module rule says nothing
    by_fqn = {r.fqn: r.source for r in report.records}
    assert by_fqn["p"].startswith("pattern") and by_fqn["lin.weight"].startswith("rule")


def test_init_method_runs_on_top_of_the_record():
    model = keyinit.deferred(Patterns)

    def scale_ls():
        with torch.no_grad():
            model.ls.mul_(3)

    report = keyinit.materialize(model, SEED, device="cpu", init_method=scale_ls)
    eager = Patterns()
    assert same_bits(model.ls.detach(), eager.ls.detach() * 3)
    assert same_bits(model.q.detach(), eager.q.detach())  # untouched by the method: the record
    by_fqn = {r.fqn: r.source for r in report.records}
    assert by_fqn["ls"] == "scale_ls" and by_fqn["q"] == "constructor"


def test_no_torch_nn_default_over_a_constructors_record():
    class ZeroHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(5, 3)
            nn.init.zeros_(self.head.weight)
            self.norm = nn.LayerNorm(3)
            self.norm.weight.data.fill_(0.5)

    model, report = _deferred_values(ZeroHead)
    assert torch.count_nonzero(model.head.weight) == 0
    assert torch.all(model.norm.weight == 0.5)
    assert report.defaults == ()


def test_report_lists_torch_nn_defaults_when_there_is_no_record():
    class ZeroHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(5, 3)
            nn.init.zeros_(self.head.weight)

    with torch.device("meta"):
        model = ZeroHead()
    report = keyinit.materialize(model, SEED, device="cpu")
    assert report.defaults == ("head.weight", "head.bias")
    assert torch.count_nonzero(model.head.weight) > 0  # what the docs warn about: the constructor's init is lost


# ----------------------------------------------------------------------------- what users do in between
class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.layers = nn.ModuleDict({str(i): nn.Linear(6, 6) for i in range(3)})
        for layer in self.layers.values():
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.ones_(layer.bias)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight  # tied in the constructor


def test_ties_survive_and_take_the_tensor_the_constructor_left():
    model, _ = _deferred_values(Stack)
    assert model.head.weight is model.emb.weight
    eager_like = keyinit.init_model(nn.Embedding(10, 6), SEED, fqn_prefix="emb")
    assert eager_like.parameters == 1


class ZeroHeadLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        nn.init.zeros_(self.head.weight)


@pytest.mark.parametrize("direction", ["head takes emb", "emb takes head"])
def test_a_tie_made_after_construction_takes_the_assigned_tensors_values(direction):
    """Tied on the meta model after deferred: both modules recorded a value; the tensor holds the one
    it was built with, as in eager torch, whichever name comes first in the model."""
    model, eager = keyinit.deferred(ZeroHeadLM), ZeroHeadLM()
    for m in (model, eager):
        if direction == "head takes emb":
            m.head.weight = m.emb.weight
        else:
            m.emb.weight = m.head.weight
    report = keyinit.materialize(model, SEED, device="cpu")
    assert model.head.weight is model.emb.weight and report.defaults == ()
    if direction == "emb takes head":
        assert torch.count_nonzero(model.emb.weight) == 0 and torch.count_nonzero(eager.emb.weight) == 0
    else:
        expected = keyinit.random.normal(keyinit.key_for(keyinit.key(SEED), "emb.weight"), (10, 6))
        assert same_bits(model.emb.weight.detach(), expected)


def test_deleting_layers_keeps_the_other_layers_values():
    full, _ = _deferred_values(Stack)
    stage = keyinit.deferred(Stack)
    del stage.layers["1"]
    keyinit.materialize(stage, SEED, device="cpu")
    state, expected = full_state(stage), full_state(full)
    assert set(state) < set(expected)
    assert_same_bits(state, {k: expected[k] for k in state}, "pipeline stage vs full model")


def test_reparenting_keeps_the_record_and_keys_by_the_new_fqn():
    built = keyinit.deferred(Stack)
    wrapper = nn.Sequential(built.layers["2"])
    keyinit.materialize(wrapper, SEED, device="cpu")
    assert torch.all(wrapper[0].bias == 1)
    expected = keyinit.random.normal(keyinit.key_for(keyinit.key(SEED), "0.weight"), (6, 6), std=0.02)
    assert same_bits(wrapper[0].weight.detach(), expected)


def test_cast_after_construction_rounds_the_float32_values():
    full, _ = _deferred_values(Stack)
    model = keyinit.deferred(Stack).to(torch.bfloat16)
    keyinit.materialize(model, SEED, device="cpu")
    for name, tensor in full_state(model).items():
        assert same_bits(tensor, full_state(full)[name].to(torch.bfloat16)), name


def test_fully_sharded_style_replacement_keeps_the_record():
    """FSDP2/TP/to_empty replace the tensor objects; the record belongs to (module, name)."""
    full, _ = _deferred_values(Stack)
    model = keyinit.deferred(Stack)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"))
    model.head.weight = model.emb.weight
    keyinit.materialize(model, SEED, device="cpu")
    assert_same_bits(full_state(model), full_state(full), "replaced tensors vs full model")


def test_init_model_after_materialize_replays_the_record_again():
    model, _ = _deferred_values(Stack)
    before = full_state(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    keyinit.init_model(model, SEED)
    assert_same_bits(full_state(model), before, "init_model again")


def test_parametrization_registered_in_the_constructor():
    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.utils.parametrizations.weight_norm(nn.Linear(5, 4))
            self.sn = nn.utils.parametrizations.spectral_norm(nn.Linear(4, 6))

    # u and v are computed from the weight's draw: one draw lands in three tensors, keyed by the first
    with pytest.warns(keyinit.SharedDrawWarning, match="keyed by 'sn.parametrizations.weight.original'"):
        model, report = _deferred_values(Normed)
    assert report.defaults == ()  # no torch.nn default over the originals the constructor recorded
    assert {r.source for r in report.records} == {"constructor"}
    # spectral_norm's power iteration ran on the constructor's weight: its v follows the original
    sn = model.sn.parametrizations.weight
    u, v, w = sn[0]._u, sn[0]._v, sn.original.detach()
    torch.testing.assert_close(v, nn.functional.normalize(w.T @ u, dim=0, eps=sn[0].eps))
    weight = model.lin.weight.detach()
    original = model.lin.parametrizations.weight.original1.detach()
    torch.testing.assert_close(weight, original)  # weight_norm starts with g = |v|: the weight is v
    # Linear's kaiming_uniform(a=sqrt(5)) draw, moved into the originals by weight_norm's right_inverse
    assert 0 < original.abs().max() <= 1 / math.sqrt(5)
    torch.testing.assert_close(model.lin.parametrizations.weight.original0.detach().reshape(-1),
                               original.norm(dim=1))


# ----------------------------------------------------------------------------- errors
class Unkeyable(nn.Module):
    def __init__(self):
        super().__init__()
        self.rate = nn.Parameter(torch.poisson(torch.ones(4)))
        self.ok = nn.Parameter(torch.ones(2))


def test_unkeyable_randomness_is_a_plan_error_naming_module_and_op():
    model = keyinit.deferred(Unkeyable)  # not at construction: a rule may cover the tensor
    with pytest.raises(keyinit.UnkeyedRandomnessError, match="poisson") as info:
        keyinit.materialize(model, SEED, device="cpu")
    assert "Unkeyable" in str(info.value) and "rate" in str(info.value)
    assert all(t.device.type == "meta" for t in model.parameters())
    keyinit.materialize(model, SEED, device="cpu", rules={"rate": init.ones()})
    assert torch.all(model.rate == 1)


def test_plain_attributes_get_real_values_and_random_ones_are_refused():
    class Attrs(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.arange(5) * 2
            self.cache = {"inv": 1.0 / torch.arange(1, 4)}

    model = keyinit.deferred(Attrs)
    assert torch.equal(model.table, torch.arange(5) * 2) and type(model.table) is torch.Tensor
    assert torch.equal(model.cache["inv"], 1.0 / torch.arange(1, 4))

    class RandomAttr(nn.Module):
        def __init__(self):
            super().__init__()
            self.noise = torch.randn(3)

    with pytest.raises(keyinit.UnkeyedRandomnessError, match="noise.*register_buffer"):
        keyinit.deferred(RandomAttr)


def test_builder_must_return_a_module():
    with pytest.raises(TypeError, match="not an nn.Module"):
        keyinit.deferred(lambda: torch.zeros(3))
    with pytest.raises(TypeError, match="callable"):
        keyinit.deferred(nn.Linear(2, 2).weight)


def test_init_model_on_a_deferred_model_points_to_materialize():
    model = keyinit.deferred(Stack)
    with pytest.raises(keyinit.PlanError, match="materialize"):
        keyinit.init_model(model, SEED)
    # allocated by the user (to_empty replaces every tensor, and unties head from emb as in eager torch):
    # init_model replays the record, the tied draw copied into both
    model.to_empty(device="cpu")
    with pytest.warns(keyinit.SharedDrawWarning, match=r"lands in \['emb.weight', 'head.weight'\]"):
        report = keyinit.init_model(model, SEED)
    assert report.defaults == () and {r.source for r in report.records} == {"constructor"}
    assert_same_bits(full_state(model), full_state(_deferred_values(Stack)[0]), "to_empty + init_model")


def test_parametrization_registered_after_deferred_starts_from_the_record():
    """weight_norm on the meta model after construction: the originals come from the constructor's
    weight through right_inverse (as torch does on a built module), not from Linear's default."""
    class Quarter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 4)
            nn.init.constant_(self.lin.weight, 0.25)

    model = keyinit.deferred(Quarter)
    nn.utils.parametrizations.weight_norm(model.lin)
    report = keyinit.materialize(model, SEED, device="cpu")
    assert report.defaults == ()
    eager = Quarter()
    nn.utils.parametrizations.weight_norm(eager.lin)
    for name in ("original0", "original1"):
        ours = getattr(model.lin.parametrizations.weight, name).detach()
        assert same_bits(ours, getattr(eager.lin.parametrizations.weight, name).detach()), name


def test_planning_pieces_of_a_huge_tensor_costs_the_program_not_the_tensor(monkeypatch):
    """2**31 elements written in pieces: coverage is decided on the pieces' grid, never with a per-element mask."""
    from keyinit._engine.planning import plan_checks
    from keyinit._engine.programs import program, replay
    from keyinit._engine.planning.plan import plan_model

    real_mask = program.written_mask

    def small_masks_only(writes, numel):
        assert numel <= program.MASK_LIMIT, f"a {numel}-element mask was allocated while planning"
        return real_mask(writes, numel)

    for module in (program, plan_checks, replay):  # each holds its own name for it
        monkeypatch.setattr(module, "written_mask", small_masks_only)

    class Huge(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(1 << 16, 1 << 15))
            self.w.data[: 1 << 15].normal_(std=0.02)
            self.w.data[1 << 15:, :100].zero_()
            self.w.data[1 << 15:, 100:].fill_(1.0)

    model = keyinit.deferred(Huge)
    plan = plan_model(model, SEED, materializing=True)
    assert plan.tensors[0].program.complete

    gap = keyinit.deferred(lambda: _with_gap(Huge()))
    with pytest.raises(keyinit.PlanError, match="only part"):
        plan_model(gap, SEED, materializing=True)

    class HugeCode(nn.Module):  # a meta model whose init code writes the pieces (issue 14)
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(1 << 16, 1 << 15, device="meta"))

        def init_weights(self):
            with torch.no_grad():
                self.w[: 1 << 15].normal_(std=0.02)
                self.w[1 << 15:, :100].zero_()
                self.w[1 << 15:, 100:].fill_(1.0)

    plan = keyinit.plan_init(HugeCode(), SEED, init_method="init_weights")
    assert plan.entry("w").origin == "code"
    assert torch.equal(plan.values("w", (slice((1 << 15) - 1, (1 << 15) + 1), slice(99, 101))),
                       torch.cat([plan.values("w", (slice((1 << 15) - 1, 1 << 15), slice(99, 101))),
                                  torch.tensor([[0.0, 1.0]])]))


def _with_gap(model):
    """A fresh tensor written in pieces that leave one column of the second half unwritten."""
    model.w = nn.Parameter(torch.empty(1 << 16, 1 << 15))
    model.w.data[: 1 << 15].normal_()
    model.w.data[1 << 15:, :100].zero_()
    model.w.data[1 << 15:, 101:].zero_()
    return model


@pytest.mark.parametrize("n", [5, 39, 78, 1000])
def test_deterministic_buffers_have_eagers_bits(n):
    """RoPE frequencies and sinusoid tables: the same torch ops over the whole (small) tensor, as in eager."""
    class Rope(nn.Module):
        def __init__(self):
            super().__init__()
            inv = 1.0 / (500000.0 ** (torch.arange(0, 2 * n, 2, dtype=torch.int64).float() / (2 * n)))
            self.register_buffer("inv_freq", inv, persistent=False)
            t = torch.arange(7).float()[:, None] * inv[None, :]
            self.register_buffer("table", torch.cat([t.sin(), t.cos(), torch.tanh(t) * 0.3], dim=1))

    model, _ = _deferred_values(Rope)
    eager = Rope()
    assert same_bits(model.inv_freq, eager.inv_freq)
    assert same_bits(model.table, eager.table)


def test_rnn_flat_weights_follow_the_parameters():
    """nn.LSTM keeps its parameters in a plain list too (_flat_weights): it must see the meta tensors,
    then the materialized ones, and the LSTM must run."""
    model = keyinit.deferred(nn.LSTM, 4, 6, num_layers=2)
    assert all(w is p for w, p in zip(model._flat_weights, model._flat_weights_names and
                                      [getattr(model, n) for n in model._flat_weights_names]))
    keyinit.materialize(model, SEED, device="cpu")
    assert all(not w.is_meta for w in model._flat_weights)
    out, _ = model(torch.ones(3, 1, 4))
    assert out.shape == (3, 1, 6) and torch.isfinite(out).all()
    eager = nn.LSTM(4, 6, num_layers=2)
    keyinit.init_model(eager, SEED)  # its reset_parameters, captured: the same keyed draws
    assert_same_bits(full_state(model), full_state(eager), "deferred LSTM vs init_model's reset_parameters")


def test_nested_deferred_is_recorded_by_the_outer_one():
    """A builder that itself calls keyinit.deferred (a factory verify wraps again) is recorded once."""
    inner = keyinit.deferred(lambda: keyinit.deferred(Patterns))
    keyinit.materialize(inner, SEED, device="cpu")
    plain, _ = _deferred_values()
    assert_same_bits(full_state(inner), full_state(plain), "nested deferred vs deferred")


class Cloned(nn.Module):
    """One layer built, then deep-copied per depth (torchtune's ``_get_clones``, many ViTs)."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        import copy

        layer = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
        self.scale = nn.Parameter(0.5 * torch.randn(6))
        layer[0].weight.marker = "colwise"  # a tensor attribute rides along with the copy
        self.layers = nn.ModuleList([copy.deepcopy(layer) for _ in range(depth)])
        self.layers[1][1].bias.data.fill_(0.25)  # a copy changed afterwards: only that copy
        self.twin = copy.deepcopy(self.scale)


def test_deepcopied_layers_start_equal_as_in_eager():
    """copy.deepcopy of a module of stand-ins is a recorded clone: every copy holds what the
    original held, as eager copies do, and a later write changes that copy only."""
    with pytest.warns(keyinit.SharedDrawWarning, match="keyed by 'layers.0.0.(weight|bias)'"):
        model, report = _deferred_values(Cloned)
    assert report.defaults == ()
    assert isinstance(model.layers[2][0].weight, nn.Parameter) and model.layers[2][0].weight.requires_grad
    assert model.layers[2][0].weight.marker == "colwise"
    for name, value in model.layers[0].state_dict().items():
        assert same_bits(model.layers[2].state_dict()[name], value), name
    assert torch.all(model.layers[1][1].bias == 0.25) and torch.all(model.layers[0][1].bias == 0)
    assert same_bits(model.twin.detach(), model.scale.detach())
    eager = Cloned()
    for name in ("layers.0.1.weight", "layers.2.1.bias", "layers.1.1.bias"):
        assert same_bits(model.get_parameter(name).detach(), eager.get_parameter(name).detach()), name


def test_tensor_built_from_zero_d_tensors_has_eagers_bits():
    """``torch.tensor([...])`` of 0-d tensors converts each element with Python dispatch excluded
    (Llama 3.1's RoPE scaling: a Python loop over the frequencies): values computed on the spot."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            freqs = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
            picked = [f if 2 * math.pi / f < 40 else f / 8 for f in freqs]
            self.register_buffer("theta", torch.tensor(picked, dtype=freqs.dtype))
            self.register_buffer("ints", freqs.new_tensor([int(f * 1000) for f in freqs]))

    model, _ = _deferred_values(Scaled)
    eager = Scaled()
    assert same_bits(model.theta, eager.theta) and same_bits(model.ints, eager.ints)

    class FromDraws(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.tensor([2 * x for x in torch.randn(3)]))

    with pytest.raises(keyinit.UnkeyedRandomnessError, match="FromDraws.*__float__"):
        keyinit.deferred(FromDraws)


def test_ops_whose_result_depends_on_values_run_on_deterministic_values_and_refuse_draws():
    """``allclose``/``nonzero``/``unique`` (data-dependent results) are computed on real values when the
    values are deterministic, as eager; on a draw they are an UnkeyedRandomnessError naming the op
    (not an internal capture failure): ``parametrizations.orthogonal`` checks its draw with allclose."""
    class Deterministic(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("idx", torch.nonzero(torch.arange(6) % 2 == 1).flatten() * 2)
            self.register_buffer("u", torch.unique(torch.tensor([3, 1, 3, 2])))
            self.w = nn.Parameter(torch.ones(3))
            if torch.allclose(torch.arange(3.0), torch.arange(3.0)):
                self.w.data.mul_(2)

    model, _ = _deferred_values(Deterministic)
    eager = Deterministic()
    for name in ("idx", "u", "w"):
        assert same_bits(getattr(model, name).detach(), getattr(eager, name).detach()), name

    class Orthogonal(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))

    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"Orthogonal.*\(allclose\)"):
        keyinit.deferred(Orthogonal)
