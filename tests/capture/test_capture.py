"""Existing init code captured on global-shape stand-ins and replayed per region (issue 8).

Every test compares a real property: values of a region equal the same region of the
one-process values, draws are keyed by where they land, the global RNG is untouched,
and what the report says wrote each tensor.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import keyinit
from keyinit import init
from keyinit.layouts import ManualShard, MegatronLayout, register_layout, unregister_layout


def keyed(fqn: str, seed: int = 0) -> keyinit.Key:
    return keyinit.key_for(seed, fqn)


def full_values(model: nn.Module, seed: int = 0, **kwargs) -> dict[str, torch.Tensor]:
    keyinit.init_model(model, seed, **kwargs)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sharded(factory, fqn_regions: dict, seed: int = 0, **kwargs) -> dict[str, torch.Tensor]:
    """Each listed tensor replaced by a plain local tensor holding only ``region`` (a manual shard)."""
    model = factory()
    shards = {}
    for fqn, region in fqn_regions.items():
        owner, _, attr = fqn.rpartition(".")
        module = model.get_submodule(owner)
        old = getattr(module, attr)
        shard = ManualShard(tuple(old.shape), region)
        local = torch.full(shard.region_shape, float("nan"), dtype=old.dtype)
        table = module._parameters if attr in module._parameters else module._buffers
        table[attr] = nn.Parameter(local, requires_grad=old.requires_grad) if attr in module._parameters else local
        shards[fqn] = shard
    keyinit.init_model(model, seed, shards=shards, **kwargs)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def take(full: torch.Tensor, region) -> torch.Tensor:
    r = keyinit.regions.make_region(tuple(full.shape), region)
    out = full
    for d, index in enumerate(r.indices):
        out = out.index_select(d, index)
    return out


# --------------------------------------------------------------------------- HF-style writes through views


class PaddedEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 6, padding_idx=29)
        self.norm_weight = nn.Parameter(torch.empty(6))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.weight[module.padding_idx])
        if module is self:
            self.norm_weight.data.fill_(1.0)


@pytest.mark.parametrize("region", [(slice(0, 19), slice(None)), (slice(19, 37), slice(None)),
                                    (slice(None), slice(3, 6)), ([29, 3, 30], [5, 0]), (slice(1, 37, 4), slice(None))])
def test_padding_row_is_zero_in_every_shard_that_holds_it(region):
    model = PaddedEmbedding()
    full = full_values(model, init_method=model._init_weights)
    assert torch.count_nonzero(full["emb.weight"][29]) == 0
    assert torch.equal(full["emb.weight"][:29], keyinit.random.normal(keyed("emb.weight"), (37, 6), std=0.02)[:29])
    assert torch.equal(full["norm_weight"], torch.ones(6))
    shard = PaddedEmbedding()
    local = sharded(lambda: shard, {"emb.weight": region}, init_method=shard._init_weights)
    assert torch.equal(local["emb.weight"], take(full["emb.weight"], region))


def test_data_fill_and_report_source():
    model = PaddedEmbedding()
    report = keyinit.init_model(model, 0, init_method=model._init_weights)
    sources = {r.fqn: r.source for r in report.records}
    assert sources == {"emb.weight": "_init_weights", "norm_weight": "_init_weights"}
    assert report.non_local == ()


# --------------------------------------------------------------------------- draws on temporaries land keyed


class FusedQKV(nn.Module):
    """torchtitan-style: trunc_normal_ on temporaries, then cat + copy_ into the fused weight."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)

    def init_weights(self, std: float = 0.02) -> None:
        dim = self.wqkv.in_features
        parts = [torch.empty(dim, dim) for _ in range(3)]
        for part in parts:
            nn.init.trunc_normal_(part, mean=0.0, std=std)
        self.wqkv.weight.copy_(torch.cat(parts, dim=0))


def test_fused_qkv_draws_are_keyed_by_position_in_the_fused_weight():
    model = FusedQKV()
    before = torch.get_rng_state()
    full = full_values(model, init_method="init_weights")
    assert torch.equal(before, torch.get_rng_state())
    base = keyed("wqkv.weight")
    for i in range(3):
        expected = torch.empty(8, 8)
        init.truncated_normal(std=0.02)(keyinit.fold_in(base, i),
                                    keyinit.layouts.Target("q", keyinit.regions.make_region((8, 8), None), expected))
        assert torch.equal(full["wqkv.weight"][8 * i:8 * (i + 1)], expected)
    for region in [(slice(5, 19), slice(None)), (slice(None), slice(2, 5)), ([23, 0, 9], slice(None))]:
        shard = FusedQKV()
        local = sharded(lambda: shard, {"wqkv.weight": region}, init_method="init_weights")
        assert torch.equal(local["wqkv.weight"], take(full["wqkv.weight"], region))
    report = keyinit.init_model(FusedQKV(), 0, init_method="init_weights")
    assert report.non_local == ()  # cat is element-local


def test_trunc_normal_on_a_temporary_after_one_on_a_parameter_is_keyed_not_zero():
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.empty(4, 4))
            self.b = nn.Parameter(torch.empty(4, 4))

        def reset_parameters(self) -> None:
            nn.init.trunc_normal_(self.a, std=0.02)
            tmp = torch.empty(4, 4)
            nn.init.trunc_normal_(tmp, std=0.02)
            with torch.no_grad():
                self.b.copy_(tmp)

    model = Both()
    keyinit.init_model(model, 0)
    assert torch.count_nonzero(model.b) == 16
    assert not torch.equal(model.a, model.b)


def test_rules_win_and_unkeyable_code_that_only_feeds_covered_tensors_is_fine():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4))
            self.v = nn.Parameter(torch.empty(4))

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.w.copy_(torch.poisson(torch.ones(4)))  # cannot be keyed
                self.v.fill_(2.0)

    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"poisson"):
        keyinit.init_model(Odd(), 0)
    model = Odd()
    keyinit.init_model(model, 0, rules={"w": init.normal()})
    assert torch.equal(model.w, keyinit.random.normal(keyed("w"), (4,)))
    assert torch.equal(model.v, torch.full((4,), 2.0))


def test_init_code_that_fails_is_fine_when_rules_cover_everything_it_writes():
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, 3))

        def init_weights(self) -> None:
            raise RuntimeError("this init code is broken")

    with pytest.raises(keyinit.PlanError, match=r"Broken at <root>: init_weights failed .*this init code is broken"):
        keyinit.init_model(Broken(), 0, init_method="init_weights")
    model = Broken()
    report = keyinit.init_model(model, 0, init_method="init_weights", rules={"w": init.zeros()})
    assert torch.equal(model.w, torch.zeros(3, 3))
    assert any("this init code is broken" in note for note in report.notes)


# --------------------------------------------------------------------------- keys depend on where a draw lands


class Layer(nn.Module):
    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(dim, dim))
        self.b = nn.Parameter(torch.empty(dim))

    def init_weights(self, scale: float = 1.0) -> None:
        tmp = torch.randn(self.w.shape) * scale
        with torch.no_grad():
            self.w.copy_(tmp)
            self.b.copy_(torch.rand(self.b.shape))


class Stack(nn.Module):
    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(n)})

    def init_weights(self) -> None:  # a root-level init walking its layers (torchtitan)
        for layer in self.layers.values():
            layer.init_weights(scale=0.5)


def test_root_level_walk_equals_per_module_init_and_a_stage_equals_the_full_model():
    root = Stack()
    walked = full_values(root, init_method="init_weights")
    per_module = Stack()
    for layer in per_module.layers.values():
        layer.init_weights = lambda layer=layer: Layer.init_weights(layer, scale=0.5)  # type: ignore[method-assign]
    keyinit.init_model(per_module, 0, init_method=lambda m: m.init_weights() if isinstance(m, Layer) else None)
    assert all(torch.equal(walked[k], v) for k, v in per_module.state_dict().items())
    stage = Stack()
    for i in range(4):
        del stage.layers[str(i)]  # the stage holding layers 4-7 keeps their FQNs
    staged = full_values(stage, init_method="init_weights")
    assert set(staged) == {f"layers.{i}.{t}" for i in range(4, 8) for t in "wb"}
    assert all(torch.equal(staged[k], walked[k]) for k in staged)


def test_draw_keys_are_the_tensor_key_folded_with_the_draw_position():
    model = Layer()
    full = full_values(model, init_method="init_weights")
    assert torch.equal(full["w"], keyinit.random.normal(keyinit.fold_in(keyed("w"), 0), (6, 6)))
    assert torch.equal(full["b"], keyinit.random.uniform(keyinit.fold_in(keyed("b"), 0), (6,)))


# --------------------------------------------------------------------------- element-wise math and non-local code


class Mamba(nn.Module):
    """HF Mamba's dt_proj.bias: exp/log/expm1 of a uniform draw on a temporary."""

    def __init__(self, n: int = 203) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.empty(n))

    def reset_parameters(self) -> None:
        dt = torch.exp(torch.rand(self.bias.shape[0]) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
        dt = dt.clamp(min=1e-4)
        with torch.no_grad():
            self.bias.copy_(dt + torch.log(-torch.expm1(-dt)))


@pytest.mark.parametrize("region", [(slice(0, 101),), (slice(101, 203),), (slice(7, 200, 3),), ([202, 5, 64, 63],)])
def test_transcendental_element_wise_code_is_bit_identical_on_every_region(region):
    full = full_values(Mamba())["bias"]
    assert bool(torch.isfinite(full).all())
    local = sharded(Mamba, {"bias": region})["bias"]
    assert torch.equal(local, take(full, region))


def test_non_local_init_code_is_evaluated_whole_and_reported():
    class Normalized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(8, 5))

        def reset_parameters(self) -> None:
            nn.init.normal_(self.w)
            with torch.no_grad():
                self.w.div_(self.w.norm(dim=1, keepdim=True))

    model = Normalized()
    report = keyinit.init_model(model, 0)
    assert report.non_local == ("w",)
    z = keyinit.random.normal(keyed("w"), (8, 5))
    assert torch.allclose(model.w, z / z.norm(dim=1, keepdim=True), rtol=0, atol=1e-6)
    local = sharded(Normalized, {"w": (slice(3, 6), slice(None))})["w"]
    assert torch.equal(local, model.w[3:6])


def test_python_code_may_read_deterministic_values_but_not_random_ones():
    class Reads(nn.Module):
        def __init__(self, draw: bool) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4))
            self.draw = draw

        def reset_parameters(self) -> None:
            x = torch.randn(4) if self.draw else torch.arange(4.0)
            scale = float(x.abs().max())  # Python needs the value
            with torch.no_grad():
                self.w.copy_(x / scale)

    model = Reads(draw=False)
    keyinit.init_model(model, 0)
    assert torch.equal(model.w, torch.arange(4.0) / 3)
    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"Reads at <root>: .*known only when keyinit has keyed it"):
        keyinit.init_model(Reads(draw=True), 0)


def test_random_fill_of_a_tensor_keyinit_does_not_manage_is_an_error():
    class Outside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))
            self.table = torch.zeros(3)  # a plain attribute made before init

        def reset_parameters(self) -> None:
            nn.init.normal_(self.w)
            nn.init.normal_(self.table)

    model = Outside()
    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"Outside at <root>: init code writes into a tensor keyinit"):
        keyinit.init_model(model, 0)
    assert torch.equal(model.table, torch.zeros(3))


# --------------------------------------------------------------------------- buffers and attributes init code creates


class Rope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        self.register_buffer("freqs", torch.empty(8), persistent=False)

    def init_weights(self, buffer_device=None) -> None:
        nn.init.normal_(self.w, std=0.02)
        with torch.device(buffer_device or "cpu"):
            self.freqs = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
            self.cache = torch.outer(torch.arange(3.0), self.freqs)  # a plain attribute
        self.register_buffer("counts", torch.zeros(5), persistent=False)


def test_re_created_buffers_new_buffers_and_attributes_with_init_kwargs():
    with torch.device("meta"):
        model = Rope()
    report = keyinit.materialize(model, 0, device="cpu", init_method="init_weights",
                                 init_kwargs={"buffer_device": torch.device("cpu")})
    expected = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    assert torch.equal(model.freqs, expected)
    assert torch.equal(model.cache, torch.outer(torch.arange(3.0), expected))
    assert torch.equal(model.counts, torch.zeros(5)) and "counts" in model._non_persistent_buffers_set
    assert {r.fqn for r in report.records} == {"w", "freqs", "cache", "counts"}
    live = Rope()
    keyinit.init_model(live, 0, init_method="init_weights", init_kwargs={"buffer_device": "cpu"})
    assert torch.equal(live.w, model.w) and torch.equal(live.cache, model.cache)


def test_init_kwargs_need_an_init_method():
    with pytest.raises(keyinit.PlanError, match="init_kwargs given without an init_method"):
        keyinit.init_model(nn.Linear(2, 2), 0, init_kwargs={"x": 1})


def test_init_method_forms():
    class HF(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                module.weight.data.normal_(0, 0.5)
                module.bias.data.fill_(0.25)

    by_name, by_method = HF(), HF()
    keyinit.init_model(by_name, 0, init_method="_init_weights")  # a method that takes a module: per module
    keyinit.init_model(by_method, 0, init_method=by_method._init_weights)
    assert torch.equal(by_name.lin.weight, by_method.lin.weight)
    assert torch.equal(by_name.lin.weight, keyinit.random.normal(keyed("lin.weight"), (3, 3), std=0.5))
    once = HF()
    keyinit.init_model(once, 0, init_method=lambda: once._init_weights(once.lin))  # no arguments: called once
    assert torch.equal(once.lin.bias, torch.full((3,), 0.25))


def test_hf_tied_embedding_keeps_its_own_init():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4, padding_idx=2)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.data.normal_(0, 0.02)
            if isinstance(module, nn.Embedding):
                module.weight.data[module.padding_idx].zero_()

    model = Tied()
    keyinit.init_model(model, 0, init_method=model._init_weights)
    assert model.head.weight is model.embed.weight
    assert torch.count_nonzero(model.embed.weight[2]) == 0


# --------------------------------------------------------------------------- torch.nn building blocks


@pytest.mark.parametrize("make", ["weight_norm", "spectral_norm", "orthogonal"])
def test_parametrized_modules(make):
    parametrize = getattr(nn.utils.parametrizations, make)
    model = nn.Sequential(parametrize(nn.Linear(4, 3)))
    report = keyinit.init_model(model, 0)
    values = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(r.source != "kept" for r in report.records)
    with torch.no_grad():
        weight = model[0].weight
    if make == "orthogonal":
        assert torch.allclose(weight @ weight.T, torch.eye(3), atol=1e-5)
    if make == "weight_norm":  # g = ||v|| per row and v is Linear's default: the parametrized weight is v
        v = values["0.parametrizations.weight.original1"]
        assert torch.allclose(weight, v, atol=1e-6)
    with torch.device("meta"):
        meta = nn.Sequential(parametrize(nn.Linear(4, 3)))
    if make == "orthogonal":  # on meta, torch leaves the orthogonal base unset: a clear PlanError
        with pytest.raises(keyinit.PlanError, match=r"parametrized \(_Orthogonal\)"):
            keyinit.materialize(meta, 0, device="cpu")
        return
    keyinit.materialize(meta, 0, device="cpu")
    assert all(torch.equal(values[k], v) for k, v in meta.state_dict().items())
    ruled = nn.Sequential(parametrize(nn.Linear(4, 3)))
    name = "0.parametrizations.weight.original1" if make == "weight_norm" else "0.parametrizations.weight.original"
    keyinit.init_model(ruled, 0, rules={name: init.zeros()})
    assert torch.equal(ruled.state_dict()[name], torch.zeros_like(values[name]))


def test_transformer_default_reproduces_its_xavier_reset():
    model = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=12)
    report = keyinit.init_model(model, 0)
    for name, p in model.named_parameters():
        if p.dim() > 1:
            expected = torch.empty(p.shape)
            init.xavier_uniform()(keyed(name), keyinit.layouts.Target(name, keyinit.regions.make_region(tuple(p.shape), None), expected))
            assert torch.equal(p, expected), name
    assert report.by_source()["default Transformer"]
    norm = model.encoder.layers[0].norm1
    assert torch.equal(norm.weight, torch.ones(8)) and torch.equal(norm.bias, torch.zeros(8))


def test_megatron_marked_tensor_parallel_parameters_are_read_as_shards():
    full = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 8))
    keyinit.init_model(full, 3)
    for rank in range(2):
        shard = nn.Sequential(nn.Embedding(5, 6), nn.Linear(6, 4))
        for p, stride in ((shard[0].weight, 1), (shard[1].weight, 2), (shard[1].bias, 2)):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, stride
        with pytest.raises(keyinit.PlanError, match=r"0.weight is marked tensor_model_parallel by megatron-core"):
            keyinit.init_model(shard, 3)
        layout = register_layout(MegatronLayout(rank, 2))
        try:
            report = keyinit.init_model(shard, 3)
        finally:
            unregister_layout(layout)
        assert report.records[0].layout == f"megatron TP[{rank}/2] dim 0"
        assert torch.equal(shard[0].weight, full[0].weight[5 * rank:5 * (rank + 1)])
        rows = [(2 * k + rank) * 2 + j for k in range(2) for j in range(2)]  # partition_stride 2
        assert torch.equal(shard[1].weight, full[1].weight[rows])
        assert torch.equal(shard[1].bias, full[1].bias[rows])  # fans from the global weight


def test_init_under_a_meta_default_device(tmp_path):
    """``with torch.device("meta")`` around keyinit (the context that built the model) must not reach kernels."""
    import subprocess
    import sys

    code = (
        "import torch, keyinit\n"
        "from torch import nn\n"
        "with torch.device('meta'):\n"
        "    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))\n"
        "    keyinit.materialize(model, 0, device='cpu')\n"
        "torch.set_default_device('meta')\n"
        "live = nn.Sequential(nn.Linear(4, 3, device='cpu'), nn.LayerNorm(3, device='cpu'))\n"
        "keyinit.init_model(live, 0)\n"
        "torch.set_default_device('cpu')\n"
        "assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), live.state_dict().values()))\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_an_out_argument_fresh_from_empty_is_written_not_read():
    """``torch.cumsum(x, 0, out=torch.empty_like(x))`` (OLMo-core's MoE bins): the out= tensor's old,
    uninitialized contents are never read; its new values are the op's, in a parameter and a cache."""

    class Bins(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4))
            self.cache: dict[str, torch.Tensor] = {}

        def reset_parameters(self) -> None:
            counts = torch.tensor([3, 1, 2, 5])
            bins = torch.empty_like(counts, dtype=torch.int32)
            torch.cumsum(counts, 0, out=bins)
            self.cache["bins"] = bins
            torch.add(bins.float(), 0.5, out=self.w)

    with torch.device("meta"):
        model = Bins()
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.cache["bins"], torch.tensor([3, 4, 6, 11], dtype=torch.int32))
    assert torch.equal(model.w.detach(), torch.tensor([3.5, 4.5, 6.5, 11.5]))


def test_a_written_argument_that_is_also_an_operand():
    """``w.mul_(w)`` and ``torch.add(w, 1, out=w)``: the operand is read as it was before the write."""

    class Square(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4))
            self.v = nn.Parameter(torch.empty(64))

        def reset_parameters(self) -> None:
            self.w.fill_(3.0)
            self.w.mul_(self.w)
            torch.add(self.w, 1.0, out=self.w)
            self.v.normal_()
            self.v.mul_(self.v)
            torch.sub(self.v, self.v.mean(), out=self.v)

    with torch.device("meta"):
        model = Square()
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.w.detach(), torch.full((4,), 10.0))
    v = model.v.detach()
    assert abs(float(v.sum())) < 1e-4 and float(v.min()) < 0 < float(v.max())
