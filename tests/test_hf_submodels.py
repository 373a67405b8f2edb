"""HF's ``smart_apply`` switches to a sub-model's ``_init_weights`` only at ``PreTrainedModel`` sub-models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import keyinit

transformers = pytest.importorskip("transformers")


class _Config(transformers.PretrainedConfig):
    model_type = "keyinit_test"


class _Helper(nn.Module):
    """Not a PreTrainedModel, but with a method of the same name and another signature (minicpm's resamplers)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def _init_weights(self):  # called by its own constructor in the real models; never by smart_apply
        raise AssertionError("HF never calls a plain module's _init_weights")


class _Model(transformers.PreTrainedModel):
    config_class = _Config

    def __init__(self, config):
        super().__init__(config)
        self.helper = _Helper()
        self.head = nn.Linear(4, 2)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.fill_(0.5)
            module.bias.data.zero_()


def test_a_plain_module_with_a_method_of_that_name_is_not_a_sub_model():
    with torch.device("meta"):
        model = _Model(_Config())
    keyinit.materialize(model, 0, device="cpu", init_method=model._init_weights)
    assert torch.all(model.helper.proj.weight == 0.5) and torch.all(model.head.weight == 0.5)
