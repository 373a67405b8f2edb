"""init_model / materialize on single-process models: values, precedence, FQNs, errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import keyinit
from keyinit import init


def keyed(fqn: str, seed: int = 0) -> keyinit.Key:
    return keyinit.key_for(seed, fqn)


def expected(initializer, fqn: str, shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    region = keyinit.regions.make_region(tuple(shape), None)
    initializer(keyed(fqn, seed), keyinit.layouts.Target(fqn, region, out))
    return out


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)


class Net(nn.Module):
    def __init__(self, dim: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 5, bias=False)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict, b: dict, keys=None) -> None:
    for name in keys or a:
        assert torch.equal(a[name], b[name]), name


def test_values_are_the_keyed_initializer_of_each_fqn():
    model = Net()
    keyinit.init_model(model, 7)
    assert torch.equal(model.emb.weight, expected(init.normal(), "emb.weight", (11, 8), 7))
    assert torch.equal(
        model.layers[1].proj.weight,
        expected(init.kaiming_uniform(a=math.sqrt(5)), "layers.1.proj.weight", (8, 8), 7),
    )
    bound = 1 / math.sqrt(8)
    assert torch.equal(model.layers[0].proj.bias, expected(init.uniform(-bound, bound), "layers.0.proj.bias", (8,), 7))
    assert torch.equal(model.layers[0].norm.weight, torch.ones(8))


def test_same_seed_same_values_and_seed_changes_values():
    a, b, c = Net(), Net(), Net()
    keyinit.init_model(a, 1)
    keyinit.init_model(b, 1)
    keyinit.init_model(c, 2)
    assert_same(state(a), state(b))
    assert not torch.equal(a.head.weight, c.head.weight)


def test_adding_or_renaming_a_module_changes_no_other_values():
    base = Net(layers=2)
    keyinit.init_model(base, 3)
    bigger = Net(layers=3)
    bigger.extra = nn.Linear(8, 8)
    keyinit.init_model(bigger, 3)
    assert_same(state(base), state(bigger))
    renamed = Net(layers=2)
    renamed.head2 = renamed.head
    del renamed.head
    keyinit.init_model(renamed, 3)
    shared = [k for k in state(base) if not k.startswith("head")]
    assert_same(state(base), state(renamed), shared)
    assert not torch.equal(renamed.head2.weight, base.head.weight)


def test_global_rng_state_is_untouched():
    model = Net()  # construction itself draws from the global RNG; keyinit must not
    with torch.device("meta"):
        meta = Net()
    before = torch.get_rng_state()
    keyinit.init_model(model, 0)
    keyinit.materialize(meta, 0, device="cpu")
    assert torch.equal(before, torch.get_rng_state())


def test_wrappers_do_not_change_values():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = Net()
    keyinit.init_model(plain, 5)
    compiled = torch.compile(Net())
    keyinit.init_model(compiled, 5)
    assert_same(state(plain), {k.replace("_orig_mod.", ""): v for k, v in state(compiled).items()})
    wrapped = Net()
    wrapped.layers[0] = checkpoint_wrapper(wrapped.layers[0])
    report = keyinit.init_model(wrapped, 5)
    assert "layers.0.proj.weight" in [r.fqn for r in report.records]
    assert torch.equal(wrapped.layers[0]._checkpoint_wrapped_module.proj.weight, plain.layers[0].proj.weight)


def test_tied_tensor_gets_one_key_and_its_first_names_rule():
    model = Net()
    model.head = nn.Linear(8, 11, bias=False)
    model.head.weight = model.emb.weight
    report = keyinit.init_model(model, 0)
    assert torch.equal(model.emb.weight, expected(init.normal(), "emb.weight", (11, 8)))
    assert [r.fqn for r in report.records].count("emb.weight") == 1
    assert "head.weight" not in [r.fqn for r in report.records]


def test_declared_tie_keys_the_alias_as_its_target():
    stage = nn.Module()
    stage.output = nn.Linear(8, 11, bias=False)
    keyinit.init_model(stage, 0, ties={"output.weight": "tok_embeddings.weight"},
                       rules={"output.weight": init.normal()})
    assert torch.equal(stage.output.weight, expected(init.normal(), "tok_embeddings.weight", (11, 8)))


def test_pattern_rule_beats_module_rule_beats_default():
    registry = keyinit.Registry()
    registry.register(nn.LayerNorm, lambda m, ctx: {"weight": init.constant(2.0)})
    model = Net()
    report = keyinit.init_model(model, 0, registry=registry, rules={"layers.1.norm.weight": init.constant(3.0)})
    assert torch.equal(model.layers[0].norm.weight, torch.full((8,), 2.0))
    assert torch.equal(model.layers[1].norm.weight, torch.full((8,), 3.0))
    assert torch.equal(model.layers[0].norm.bias, torch.zeros(8))  # default rule for the rest
    sources = {r.fqn: r.source for r in report.records}
    assert sources["layers.1.norm.weight"] == "pattern layers.1.norm.weight"
    assert sources["layers.0.norm.weight"] == "rule LayerNorm"
    assert sources["layers.0.norm.bias"] == "default LayerNorm"


def test_decorator_registration_and_subclass_lookup():
    registry = keyinit.Registry()

    class MyLinear(nn.Linear):
        pass

    @registry.register(nn.Linear)
    def zero_linear(module, ctx):
        assert ctx.global_shape("weight") == tuple(module.weight.shape)
        return {name: init.zeros() for name in ("weight", "bias") if getattr(module, name) is not None}

    @registry.register_pattern("emb.*")
    def fives(key, target):
        target.out.fill_(5.0)

    model = Net()
    model.head = MyLinear(8, 5)
    keyinit.init_model(model, 0, registry=registry)
    assert torch.equal(model.head.weight, torch.zeros(5, 8))
    assert torch.equal(model.emb.weight, torch.full((11, 8), 5.0))


class Legacy(nn.Module):
    """Existing init code, unmodified: every nn.init flavour and Tensor methods."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(6, 4))
        self.b = nn.Parameter(torch.empty(6, 4))
        self.c = nn.Parameter(torch.empty(6, 4))
        self.d = nn.Parameter(torch.empty(6, 4))
        self.e = nn.Parameter(torch.empty(6))
        self.f = nn.Parameter(torch.empty(6, 4))
        self.register_buffer("pos", torch.empty(5), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.a, std=0.02, a=-0.04, b=0.04)
        nn.init.xavier_uniform_(self.b, gain=2.0)
        nn.init.kaiming_normal_(self.c, mode="fan_out", nonlinearity="relu")
        self.d.data.normal_(0.0, 0.5)
        nn.init.uniform_(self.e, -1, 1)
        nn.init.trunc_normal_(self.f, std=1.0, a=2.0, b=3.0)  # narrow bounds: the rejection branch
        with torch.no_grad():
            self.pos.copy_(torch.arange(5.0))


def test_existing_init_code_becomes_keyed():
    model = Legacy()
    before = torch.get_rng_state()
    report = keyinit.init_model(model, 11)
    assert torch.equal(before, torch.get_rng_state())
    assert torch.equal(model.a, expected(init.truncated_normal(std=0.02, a=-0.04, b=0.04), "a", (6, 4), 11))
    assert torch.equal(model.b, expected(init.xavier_uniform(gain=2.0), "b", (6, 4), 11))
    assert torch.equal(model.c, expected(init.kaiming_normal(mode="fan_out", nonlinearity="relu"), "c", (6, 4), 11))
    assert torch.equal(model.e, expected(init.uniform(-1, 1), "e", (6,), 11))
    assert torch.equal(model.f, expected(init.truncated_normal(std=1.0, a=2.0, b=3.0), "f", (6, 4), 11))
    assert torch.equal(model.pos, torch.arange(5.0))
    assert {r.source for r in report.records} == {"reset_parameters"}


def test_data_alias_is_keyed_like_the_parameter():
    """HF code writes ``module.weight.data.normal_()``: ``.data`` is a new object over the same elements."""

    class DataAlias(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, 2))

        def reset_parameters(self) -> None:
            self.w.data.normal_(0.0, 0.5)

    model = DataAlias()
    keyinit.init_model(model, 0)
    assert torch.equal(model.w, expected(init.normal(std=0.5), "w", (3, 2)))


def test_random_fill_of_a_partial_view_is_keyed_by_its_position_in_the_tensor():
    """A draw on a view is keyed ``fold_in(key_for(seed, fqn), position)``; elements no code writes keep
    their values under init_model (and are an error under materialize, which has none)."""

    class RowInit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.full((3, 2), 7.0))

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.w[0].normal_()

    model = RowInit()
    report = keyinit.init_model(model, 0)
    row = keyinit.random.normal(keyinit.fold_in(keyed("w"), 0), (2,))
    assert torch.equal(model.w[0], row)
    assert torch.equal(model.w[1:], torch.full((2, 2), 7.0))
    assert report.records[0].source == "reset_parameters"
    with torch.device("meta"):
        meta = RowInit()
    with pytest.raises(keyinit.PlanError, match=r"init code writes only part of these tensors .*: w") as info:
        keyinit.materialize(meta, 0, device="cpu")
    assert info.value.fqns == ("w",) and meta.w.is_meta


def test_torchtitan_style_init_weights():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq = nn.Linear(8, 8, bias=False)
            self.wo = nn.Linear(8, 8, bias=False)

        def init_weights(self, std: float) -> None:
            nn.init.trunc_normal_(self.wq.weight, mean=0.0, std=0.02)
            nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(10, 8)
            self.attn = Attention()

        def init_weights(self) -> None:
            nn.init.normal_(self.tok.weight)
            self.attn.init_weights(std=0.01)

    model = Transformer()
    report = keyinit.init_model(model, 0, init_method="init_weights")
    assert torch.equal(model.attn.wq.weight, expected(init.truncated_normal(std=0.02), "attn.wq.weight", (8, 8)))
    assert torch.equal(model.attn.wo.weight, expected(init.truncated_normal(std=0.01), "attn.wo.weight", (8, 8)))
    assert {r.source for r in report.records} == {"init_weights"}


def test_hf_style_init_weights_callable():
    class HFModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Linear(8, 8)
            self.ln = nn.LayerNorm(8)

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                module.weight.normal_(mean=0.0, std=0.02)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.bias.zero_()
                module.weight.fill_(1.0)

    model = HFModel()
    keyinit.init_model(model, 0, init_method=model._init_weights)
    assert torch.equal(model.dense.weight, expected(init.normal(std=0.02), "dense.weight", (8, 8)))
    assert torch.equal(model.dense.bias, torch.zeros(8))


def test_draw_on_a_temporary_is_keyed_by_where_it_lands():
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.w.copy_(torch.randn(3) * 0.5)

    model = nn.Sequential(nn.Linear(2, 2), Noisy())
    before = torch.get_rng_state()
    keyinit.init_model(model, 0)
    assert torch.equal(before, torch.get_rng_state())
    z = keyinit.random.normal(keyinit.fold_in(keyed("1.w"), 0), (3,))
    assert torch.equal(model[1].w, z * 0.5)


def test_unkeyable_randomness_is_an_error_naming_the_module_and_op():
    class Poisson(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3))  # not empty(): NaN garbage would fail the equality below

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.w.copy_(torch.poisson(torch.ones(3)))

    model = nn.Sequential(nn.Linear(2, 2), Poisson())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"Poisson at 1: init code called poisson\(\)"):
        keyinit.init_model(model, 0)
    assert_same(before, model.state_dict())  # raised while planning: nothing written
    # A rule for the tensor wins, and the init code that fed it no longer matters.
    keyinit.init_model(model, 0, rules={"1.w": init.zeros()})
    assert torch.equal(model[1].w, torch.zeros(3))


def test_module_without_rule_or_method_is_a_plan_error():
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(3))

    model = nn.Sequential(Bare())
    before = model[0].w.detach().clone()
    with pytest.raises(keyinit.PlanError, match=r"no rule or init method covers these tensors: 0\.w\.") as info:
        keyinit.init_model(model, 0)
    assert info.value.fqns == ("0.w",)
    assert torch.equal(model[0].w, before)


def test_strict_pattern_that_matches_nothing():
    with pytest.raises(keyinit.PlanError, match=r"FQN rules matched no tensor of this model: \['nope\.\*'\]"):
        keyinit.init_model(Net(), 0, rules={"nope.*": init.zeros()})
    keyinit.init_model(Net(), 0, rules={"nope.*": init.zeros()}, strict=False)
    # a pattern that matches, even where an earlier pattern wins, is not "unmatched"
    keyinit.init_model(Net(), 0, rules={"head.weight": init.zeros(), "head.*": init.ones()})


def test_tie_to_unknown_fqn():
    with pytest.raises(keyinit.PlanError, match=r"tie 'x\.weight' -> 'y\.weight' names no tensor of this model"):
        keyinit.init_model(Net(), 0, ties={"x.weight": "y.weight"})


def test_two_tensors_with_the_same_canonical_fqn():
    with pytest.raises(keyinit.PlanError, match=r"two different tensors have the canonical FQN 'same'"):
        keyinit.init_model(Net(), 0, fqn_map=lambda fqn: "same")


def test_rule_that_raises_while_planning_leaves_model_unchanged():
    registry = keyinit.Registry()

    @registry.register(nn.LayerNorm)
    def broken(module, ctx):
        raise RuntimeError("boom")

    model = Net()
    before = state(model)
    with pytest.raises(keyinit.PlanError, match=r"rule LayerNorm raised while planning layers.0.norm: RuntimeError\('boom'\)"):
        keyinit.init_model(model, 0, registry=registry)
    assert_same(before, state(model))


def test_initializer_that_raises_halfway_reports_exactly_what_was_written():
    calls = []

    def flaky(key, target):
        calls.append(target.fqn)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        target.out.fill_(9.0)

    model = Net()
    before = state(model)
    with pytest.raises(keyinit.InitError) as info:
        keyinit.init_model(model, 0, rules={"layers.*.proj.weight": flaky})
    # Defaults run first (lowest precedence), then the pattern rule, which fails on its second tensor.
    assert set(info.value.written) == set(before) - {"layers.1.proj.weight"}
    assert "disk on fire" in str(info.value) and "layers.0.proj.weight" in str(info.value)
    after = state(model)
    assert torch.equal(after["layers.1.proj.weight"], before["layers.1.proj.weight"])
    assert torch.equal(after["layers.0.proj.weight"], torch.full((8, 8), 9.0))


def test_materialize_equals_init_model():
    plain = Net()
    keyinit.init_model(plain, 4)
    with torch.device("meta"):
        meta = Net()
    report = keyinit.materialize(meta, 4, device="cpu")
    assert_same(state(plain), state(meta))
    assert report.parameters == len(list(plain.parameters()))


def test_materialize_restores_ties_that_to_empty_breaks():
    with torch.device("meta"):
        model = Net()
        model.head = nn.Linear(8, 11, bias=False)
        model.head.weight = model.emb.weight
    keyinit.materialize(model, 0, device="cpu")
    assert model.head.weight is model.emb.weight


def test_materialize_fails_before_allocating_when_a_buffer_is_uncovered():
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("table", torch.empty(4))

    with torch.device("meta"):
        model = WithBuffer()
    with pytest.raises(keyinit.PlanError, match=r"no rule or init method covers these tensors: table\."):
        keyinit.materialize(model, 0, device="cpu")
    assert all(t.is_meta for t in model.state_dict().values())


def test_materialize_failure_returns_the_model_to_meta():
    def broken(key, target):
        raise RuntimeError("nope")

    with torch.device("meta"):
        model = Net()
    with pytest.raises(keyinit.InitError, match="returned to the meta device"):
        keyinit.materialize(model, 0, device="cpu", rules={"head.weight": broken})
    assert all(t.is_meta for t in model.state_dict().values())


def test_init_model_rejects_meta_tensors():
    with torch.device("meta"):
        model = Net()
    with pytest.raises(keyinit.PlanError, match="use keyinit.materialize"):
        keyinit.init_model(model, 0)


def test_report_counts_and_table():
    model = Net()
    report = keyinit.init_model(model, 0)
    total = sum(p.numel() for p in model.parameters())
    assert report.elements == total and report.local_elements == total
    assert report.parameters == len(list(model.parameters()))
    text = str(report)
    assert "emb.weight" in text and "default Embedding" in text


def test_seed_validation_names_the_problem():
    with pytest.raises(TypeError, match=r"seed must be an int in \[0, 2\*\*64\), got float"):
        keyinit.init_model(Net(), 1.5)


def test_manual_row_shards_equal_slices_of_the_full_table():
    """Lightning-style manual parallelism: each 'rank' holds rows of an embedding table as a plain tensor."""
    full = nn.Embedding(10, 4)
    keyinit.init_model(full, 9)
    bounds = keyinit.layouts.chunk_bounds
    for rank in range(3):
        start, stop = bounds(10, 3, rank)
        shard = nn.Embedding(stop - start, 4)
        keyinit.layouts.declare_shard(shard, "weight", global_shape=(10, 4), region=(slice(start, stop), slice(None)))
        report = keyinit.init_model(shard, 9)
        assert torch.equal(shard.weight, full.weight[start:stop])
        assert report.local_elements == (stop - start) * 4 and report.elements == 40


def test_manual_shards_passed_by_fqn_and_fans_come_from_the_global_shape():
    full = nn.Linear(6, 8)
    keyinit.init_model(full, 2)
    half = nn.Linear(3, 8)  # column shard of the weight: the LOCAL fan_in (3) would give another bound
    shards = {
        "weight": keyinit.layouts.ManualShard((8, 6), (slice(None), slice(3, 6))),
        "bias": keyinit.layouts.ManualShard((8,), (slice(None),)),
    }
    keyinit.init_model(half, 2, shards=shards)
    assert torch.equal(half.weight, full.weight[:, 3:])
    assert torch.equal(half.bias, full.bias)


def test_pipeline_stage_with_rewritten_fqns_uses_fqn_prefix_or_map():
    model = Net(layers=2)
    keyinit.init_model(model, 6)
    stage = Block()  # e.g. torch.distributed.pipelining's submodule for layers.1
    keyinit.init_model(stage, 6, fqn_prefix="layers.1")
    assert torch.equal(stage.proj.weight, model.layers[1].proj.weight)
    renamed = nn.Module()
    renamed.layers_1_proj = nn.Linear(8, 8)
    keyinit.init_model(renamed, 6, fqn_map={"layers_1_proj.weight": "layers.1.proj.weight",
                                            "layers_1_proj.bias": "layers.1.proj.bias"})
    assert torch.equal(renamed.layers_1_proj.weight, model.layers[1].proj.weight)
    assert torch.equal(renamed.layers_1_proj.bias, model.layers[1].proj.bias)


def test_integer_and_bool_buffers():
    bn = nn.BatchNorm1d(3)
    bn.num_batches_tracked.fill_(7)
    keyinit.init_model(bn, 0)
    assert bn.num_batches_tracked.dtype == torch.int64 and int(bn.num_batches_tracked) == 0

    class Flags(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(2))
            self.register_buffer("mask", torch.ones(3, dtype=torch.bool))

    flags = Flags()
    with pytest.raises(keyinit.PlanError, match=r"mask: normal draws floating-point values and cannot fill a torch.bool") as info:
        keyinit.init_model(flags, 0, rules={"w": init.zeros(), "mask": init.normal()})
    assert info.value.fqns == ("mask",) and bool(flags.mask.all())  # nothing was written
