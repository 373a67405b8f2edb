"""Each level of the documented rule precedence, one test per pair of neighbouring levels.

Highest first: FQN rules passed to ``init_model(rules=)``; FQN rules registered with
``register_pattern`` (newest first); module rules passed to ``init_model(rules=)``
(along the MRO); registered module rules (along the MRO); the ``init_method``; the
module's own ``reset_parameters()``; the built-in torch.nn defaults. Every level writes
a different constant, so the winner is read off the values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import keyinit
from keyinit import init


def const(value: float) -> init.constant:
    return init.constant(value)


def linear_rule(value: float):
    return lambda module, ctx: {"weight": const(value), "bias": const(value)}


class MyLinear(nn.Linear):
    pass


def weight_of(model: nn.Module, **kwargs) -> float:
    keyinit.init_model(model, 0, **kwargs)
    values = model.weight.detach().unique()
    assert values.numel() == 1, values
    return float(values)


def test_passed_fqn_rules_beat_registered_patterns():
    registry = keyinit.Registry()
    registry.register_pattern("weight", const(2.0))
    assert weight_of(nn.Linear(3, 3), registry=registry, rules={"weight": const(1.0)}) == 1.0


def test_the_first_matching_passed_fqn_rule_wins():
    assert weight_of(nn.Linear(3, 3), rules={"weight": const(1.0), "*": const(2.0)}) == 1.0
    assert weight_of(nn.Linear(3, 3), rules={"*": const(2.0), "weight": const(1.0)}) == 2.0


def test_registered_patterns_are_tried_newest_first():
    registry = keyinit.Registry()
    registry.register_pattern("*", const(3.0))
    registry.register_pattern("weight", const(2.0))
    assert weight_of(nn.Linear(3, 3), registry=registry) == 2.0
    registry = keyinit.Registry()
    registry.register_pattern("weight", const(2.0))
    registry.register_pattern("*", const(3.0))
    assert weight_of(nn.Linear(3, 3), registry=registry) == 3.0


def test_registered_patterns_beat_passed_module_rules():
    registry = keyinit.Registry()
    registry.register_pattern("weight", const(2.0))
    assert weight_of(nn.Linear(3, 3), registry=registry, rules={nn.Linear: linear_rule(4.0)}) == 2.0


def test_passed_module_rules_beat_registered_module_rules():
    registry = keyinit.Registry()
    registry.register(nn.Linear, linear_rule(5.0))
    assert weight_of(nn.Linear(3, 3), registry=registry, rules={nn.Linear: linear_rule(4.0)}) == 4.0
    # passed before registered, whatever the MRO distance: a passed base-class rule beats a
    # registered rule for the exact type
    registry.register(MyLinear, linear_rule(6.0))
    assert weight_of(MyLinear(3, 3), registry=registry, rules={nn.Linear: linear_rule(4.0)}) == 4.0


def test_module_rules_follow_the_mro_exact_type_first():
    assert weight_of(MyLinear(3, 3), rules={nn.Linear: linear_rule(4.0), MyLinear: linear_rule(7.0)}) == 7.0
    registry = keyinit.Registry()
    registry.register(nn.Linear, linear_rule(5.0))
    registry.register(MyLinear, linear_rule(6.0))
    assert weight_of(MyLinear(3, 3), registry=registry) == 6.0
    assert weight_of(nn.Linear(3, 3), registry=registry) == 5.0


class WithInitCode(nn.Linear):
    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 9.0)
        if self.bias is not None:
            nn.init.constant_(self.bias, 9.0)

    def init_weights(self) -> None:
        nn.init.constant_(self.weight, 8.0)


def test_registered_module_rules_beat_the_init_method():
    registry = keyinit.Registry()
    registry.register(WithInitCode, linear_rule(5.0))
    assert weight_of(WithInitCode(3, 3), registry=registry, init_method="init_weights") == 5.0


def test_the_init_method_beats_reset_parameters():
    model = WithInitCode(3, 3)
    assert weight_of(model, registry=keyinit.Registry(), init_method="init_weights") == 8.0
    assert float(model.bias.detach().unique()) == 9.0  # what init_weights leaves alone, reset_parameters wrote


def test_reset_parameters_beats_the_built_in_default():
    assert weight_of(WithInitCode(3, 3), registry=keyinit.Registry()) == 9.0


def test_the_built_in_default_applies_when_nothing_else_does():
    model = nn.Linear(3, 3)
    keyinit.init_model(model, 0, registry=keyinit.Registry())
    bound = 1 / 3**0.5
    assert model.weight.unique().numel() == 9 and float(model.weight.detach().abs().max()) <= bound
    expected = nn.Linear(3, 3)
    keyinit.init_model(expected, 0, registry=keyinit.Registry(), rules={"weight": init.kaiming_uniform(a=5**0.5)})
    assert torch.equal(model.weight, expected.weight)


class SharedBias(nn.Module):
    """An alias made in the constructor (HF's LM heads): ``decoder.bias`` is the root's ``bias``,
    assigned after ``nn.Linear`` ran its own ``reset_parameters``, so eager torch leaves it zero."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(8))
        self.decoder = nn.Linear(4, 8)
        self.decoder.bias = self.bias


def test_a_torch_nn_default_never_reaches_a_tensor_through_an_alias():
    with torch.device("meta"):
        model = SharedBias()
    with pytest.raises(keyinit.PlanError) as err:
        keyinit.materialize(model, 0, device="cpu")
    assert err.value.fqns == ("bias",)
    assert "keyinit.deferred" in str(err.value)
    assert model.bias.is_meta  # nothing was written


def test_built_deferred_the_alias_keeps_its_constructor_value():
    eager = SharedBias()
    model = keyinit.deferred(SharedBias)
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.bias, eager.bias) and model.decoder.bias is model.bias
    assert model.decoder.weight.std() > 0  # the Linear's own default, keyed


def test_the_missing_tensor_error_points_an_hf_style_model_to_its_init_weights():
    class WithInitWeights(SharedBias):
        def _init_weights(self, module):
            pass

    with torch.device("meta"):
        model = WithInitWeights()
    with pytest.raises(keyinit.PlanError, match="pass init_method=model._init_weights"):
        keyinit.materialize(model, 0, device="cpu")


class InitsInItsConstructor(nn.Module):
    """The newcomer's model: ``self.apply(self._init_weights)`` in ``__init__``, built on meta."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)


def test_defaults_on_a_meta_model_with_unused_init_code_are_named_in_the_notes():
    with torch.device("meta"):
        model = InitsInItsConstructor()
    report = keyinit.materialize(model, 0, device="cpu")
    assert report.defaults == ("emb.weight",)
    (note,) = report.notes
    assert "InitsInItsConstructor._init_weights" in note and "keyinit.deferred" in note and "emb.weight" in note
    assert f"note: {note}" in str(report)
    # the model's own init through either way in: no defaults, no note
    for report in (keyinit.materialize(keyinit.deferred(InitsInItsConstructor), 0, device="cpu"),
                   keyinit.init_model(InitsInItsConstructor(), 0, init_method="_init_weights")):
        assert report.defaults == () and report.notes == ()
