"""Which real tensors ``materialize`` keeps: the ones the user loaded, not the ones a constructor drew.

Under ``torch.device("meta")`` a constructor makes real tensors with functions that ignore the device
(HF DiffLlama's ``torch.normal(0, std, size=...)``, from torch's global RNG); its init code overwrites them.
Such a tensor is not "loaded": ``materialize`` must not keep the global RNG's values. Where keyinit cannot
tell (a real tensor that captured init code writes, in a model not built by ``keyinit.deferred``), it
refuses before allocating anything, naming the tensors; ``loaded=`` says which were loaded.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import keyinit
from keyinit.errors import PlanError


class Drawn(nn.Module):
    """A constructor that draws a real tensor under meta and init code that overwrites it (DiffLlama's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.lam = nn.Parameter(torch.normal(0, 0.1, size=(4,)))

    def init(self, module: nn.Module) -> None:
        if isinstance(module, Drawn):
            nn.init.normal_(module.lam, 0, 0.1)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0, 0.02)
            nn.init.zeros_(module.bias)


def drawn_on_meta(torch_seed: int = 0) -> Drawn:
    torch.manual_seed(torch_seed)
    with torch.device("meta"):
        model = Drawn()
    assert not model.lam.is_meta and model.proj.weight.is_meta  # what the constructor does under meta
    return model


def test_a_drawn_tensor_that_init_code_writes_is_refused_naming_it_before_anything_is_allocated():
    model = drawn_on_meta()
    lam = model.lam
    state = torch.get_rng_state()
    with pytest.raises(PlanError, match=r"^materialize: 1 tensors are not on the meta device although the init "
                                        r"code writes them: lam\. .*loaded=\(\) writes them all") as err:
        keyinit.materialize(model, 7, init_method=model.init, device="cpu")
    assert err.value.fqns == ("lam",)
    assert model.lam is lam and model.proj.weight.is_meta and model.proj.bias.is_meta
    assert torch.equal(state, torch.get_rng_state())
    with pytest.raises(PlanError, match="lam"):
        keyinit.plan_init(model, 7, init_method=model.init)  # the same plan materialize applies


def test_declared_nothing_loaded_the_drawn_tensor_gets_the_plans_keyed_values_whatever_torchs_seed():
    values = []
    for torch_seed in (0, 1):
        model = drawn_on_meta(torch_seed)
        plan = keyinit.plan_init(model, 7, init_method=model.init, loaded=())
        expected = {fqn: plan.values(fqn) for fqn in plan.fqns}
        state = torch.get_rng_state()
        report = keyinit.materialize(model, 7, init_method=model.init, device="cpu", loaded=())
        assert torch.equal(state, torch.get_rng_state())  # the global RNG is neither read nor advanced
        assert {r.fqn: r.source for r in report.records}["lam"] == "init"
        assert set(expected) == {"lam", "proj.weight", "proj.bias"}
        for fqn, value in expected.items():
            assert torch.equal(model.get_parameter(fqn), value), fqn
        values.append(model.lam.detach().clone())
    assert torch.equal(values[0], values[1])
    assert not torch.equal(values[0], drawn_on_meta(0).lam)  # not the constructor's global-RNG draw


def test_declared_loaded_tensors_are_kept_and_every_other_real_tensor_is_written():
    model = drawn_on_meta()
    weight = torch.arange(12.0).reshape(3, 4)
    model.load_state_dict({"proj.weight": weight}, strict=False, assign=True)
    reference = drawn_on_meta()
    plan = keyinit.plan_init(reference, 7, init_method=reference.init, loaded=())
    report = keyinit.materialize(model, 7, init_method=model.init, device="cpu", loaded={"proj.weight": weight})
    assert torch.equal(model.proj.weight, weight)
    assert torch.equal(model.lam, plan.values("lam")) and torch.equal(model.proj.bias, plan.values("proj.bias"))
    assert {r.fqn: r.source for r in report.records}["proj.weight"] == "kept"
    assert any(note.startswith("kept 1 tensors") and note.endswith(": proj.weight") for note in report.notes)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def init(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def test_a_loaded_tensor_no_captured_code_writes_is_kept_without_saying_so():
    with torch.device("meta"):
        model = Plain()
    loaded = {"a.weight": torch.full((4, 4), 3.0), "a.bias": torch.full((4,), 2.0)}
    model.load_state_dict(loaded, strict=False, assign=True)
    report = keyinit.materialize(model, 0, device="cpu")  # torch.nn's defaults: no constructor draws with them
    assert torch.equal(model.a.weight, loaded["a.weight"]) and torch.equal(model.a.bias, loaded["a.bias"])
    assert {r.fqn: r.source for r in report.records}["a.weight"] == "kept"
    assert not model.b.weight.is_meta


def test_a_deferred_model_keeps_what_was_assigned_though_init_code_writes_it():
    model = keyinit.deferred(Plain)  # its constructor left every tensor on meta: a real one was assigned since
    loaded = {"a.weight": torch.full((4, 4), 3.0)}
    model.load_state_dict(loaded, strict=False, assign=True)
    report = keyinit.materialize(model, 0, init_method=model.init, device="cpu")
    assert torch.equal(model.a.weight, loaded["a.weight"]) and torch.equal(model.b.weight, torch.ones(2, 4))
    assert {r.fqn: r.source for r in report.records}["a.weight"] == "kept"


def test_bad_loaded_arguments_are_clear_errors_before_anything_is_allocated():
    model = drawn_on_meta()
    with pytest.raises(PlanError, match=r"^materialize: loaded= names \['proj\.wieght'\], which the model has no "
                                        r"tensor of \(strict=False ignores them\)$"):
        keyinit.materialize(model, 0, init_method=model.init, device="cpu", loaded=["proj.wieght", "lam"])
    with pytest.raises(PlanError, match=r"^materialize: loaded= names \['proj\.bias'\], which are still on the "
                                        r"meta device \(loading into a meta model needs load_state_dict\(\.\.\., "
                                        r"assign=True\)\)$"):
        keyinit.materialize(model, 0, init_method=model.init, device="cpu", loaded=["proj.bias"])
    with pytest.raises(TypeError, match="loaded= takes the state dict you loaded or an iterable of FQNs, got str"):
        keyinit.materialize(model, 0, init_method=model.init, device="cpu", loaded="lam")
    assert model.proj.weight.is_meta
    keyinit.materialize(model, 0, init_method=model.init, device="cpu", loaded=["proj.wieght", "lam"], strict=False)
    with pytest.raises(ValueError, match=r"^loaded= is for a meta-device model \(materialize\); this model is "
                                         r"allocated$"):
        keyinit.plan_init(Plain(), 0, loaded=())


def test_hf_diffllama_materialized_with_its_init_weights_gets_keyed_lambdas():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DiffLlamaModel"):
        pytest.skip("this transformers has no DiffLlama")
    from tests._support.hf_arch import tiny_config

    config = tiny_config("diffllama")
    config.num_key_value_heads = config.num_attention_heads  # DiffLlama splits the KV heads in two
    lambdas = [f"layers.0.self_attn.lambda_{n}" for n in ("q1", "k1", "q2", "k2")]
    values = []
    for torch_seed in (0, 1):
        torch.manual_seed(torch_seed)
        with torch.device("meta"):
            model = transformers.DiffLlamaModel(config)
        assert all(not model.get_parameter(n).is_meta for n in lambdas)  # the constructor's torch.normal
        with pytest.raises(PlanError, match=r"although the init code writes them: layers\.0\.self_attn\.lambda_q1"):
            keyinit.materialize(model, 5, init_method=model._init_weights, device="cpu")
        plan = keyinit.plan_init(model, 5, init_method=model._init_weights, loaded=())
        expected = {n: plan.values(n) for n in lambdas}
        state = torch.get_rng_state()
        keyinit.materialize(model, 5, init_method=model._init_weights, device="cpu", loaded=())
        assert torch.equal(state, torch.get_rng_state())
        for n in lambdas:
            assert torch.equal(model.get_parameter(n), expected[n]), n
        values.append([model.get_parameter(n).detach().clone() for n in lambdas])
    assert all(torch.equal(a, b) for a, b in zip(*values))
