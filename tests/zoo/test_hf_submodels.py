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


class _HeadFirst(transformers.PreTrainedModel):
    """The LM head registered before the embedding it is tied to (HF ties ``head.weight`` to
    ``emb.weight`` after init): the tie source's own init must win, padding row included, and the
    root's writes through the head must not reach it."""

    config_class = _Config
    _tied_weights_keys = {"head.weight": "emb.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.head = nn.Linear(8, 64, bias=False)
        self.emb = nn.Embedding(64, 8, padding_idx=3)
        self.post_init()

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, 0.02)
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(0.0, 1.0)
            module.weight.data[module.padding_idx].zero_()
        elif module is self:  # an ancestor writing through the alias (ModernBERT's root)
            module.head.weight.data.normal_(0.0, 0.001)


def test_the_hf_tie_source_keeps_its_own_init_on_the_init_method_path():
    config = _Config(tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        eager = _HeadFirst(config)
    assert eager.head.weight is eager.emb.weight
    assert eager.emb.weight.std() > 0.5 and not eager.emb.weight[3].any()  # HF's own semantics, eagerly
    with torch.device("meta"):
        model = _HeadFirst(config)
    keyinit.materialize(model, 0, device="cpu", init_method=model._init_weights)
    assert model.head.weight is model.emb.weight
    weight = model.emb.weight.detach()
    assert not weight[3].any(), "the embedding's padding row (the tie source's own init) was lost"
    assert 0.9 < float(weight.std()) < 1.1, "an alias's init overrode the tie source's"


def test_modernbert_embedding_keeps_its_std_on_the_init_method_path():
    from keyinit.cli._fidelity import compare

    config = transformers.ModernBertConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                           num_attention_heads=2, pad_token_id=1, bos_token_id=2, eos_token_id=2,
                                           sep_token_id=2, cls_token_id=2, mask_token_id=2)
    eager = []
    for seed in (0, 1):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            eager.append(transformers.ModernBertForMaskedLM(config))
    with torch.device("meta"):
        model = transformers.ModernBertForMaskedLM(config)
    keyinit.materialize(model, 0, device="cpu", init_method=model._init_weights)
    name = "model.embeddings.tok_embeddings.weight"
    check, difference = compare(model.get_parameter(name).detach(), eager[0].get_parameter(name).detach(),
                                eager[1].get_parameter(name).detach())
    assert check == "distribution" and difference is None, difference
