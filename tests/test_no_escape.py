"""No stand-in escapes the capture: tensors init code or a constructor leaves outside parameters and
buffers (a RoPE cache dict, a list, a plain attribute) get their real values, or planning fails naming them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import keyinit
from keyinit.capture import LazyTensor


class BufferCache(dict):
    """OLMo-core keeps RoPE tables in a dict-like cache, not in module buffers."""


class WithCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.cache = BufferCache()
        self.tables = []

    def init_weights(self, max_seq_len=4):
        nn.init.zeros_(self.proj.weight)
        self.cache["sin"] = torch.arange(max_seq_len).float().sin()
        self.tables.append(torch.ones(2) * 3)


def test_init_code_caches_get_real_values():
    with torch.device("meta"):
        model = WithCache()
    keyinit.materialize(model, 0, device="cpu", init_method="init_weights", init_kwargs={"max_seq_len": 6})
    assert type(model.cache["sin"]) is torch.Tensor and not isinstance(model.cache["sin"], LazyTensor)
    assert torch.equal(model.cache["sin"], torch.arange(6).float().sin())
    assert torch.equal(model.tables[0], torch.full((2,), 3.0))
    model.proj(torch.ones(1, 4))  # the first forward works


def test_random_values_stored_in_a_cache_are_a_plan_error_naming_it():
    class Noisy(WithCache):
        def init_weights(self):
            self.cache["noise"] = torch.randn(3)

    with torch.device("meta"):
        model = Noisy()
    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"cache\['noise'\].*register_buffer"):
        keyinit.materialize(model, 0, device="cpu", init_method="init_weights")
    assert model.proj.weight.is_meta


def test_constructor_caches_get_real_values():
    class Built(nn.Module):
        def __init__(self):
            super().__init__()
            self.cache = {"cos": torch.arange(4).float().cos()}

    model = keyinit.deferred(Built)
    assert type(model.cache["cos"]) is torch.Tensor
    assert torch.equal(model.cache["cos"], torch.arange(4).float().cos())
