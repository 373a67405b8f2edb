"""No stand-in escapes the capture: tensors init code or a constructor leaves outside parameters and
buffers (a RoPE cache dict, a list, a plain attribute) get their real values, or planning fails naming them."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import MutableMapping
from typing import Optional

import pytest
import torch
from torch import nn

import keyinit
from keyinit._engine.capture.capture import LazyTensor


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


class SharedCache(MutableMapping):
    """OLMo-core 3's ``BufferCache``: a mapping class (not a dict) over a dict of dicts, whose
    namespace views share one store across every module that holds one."""

    def __init__(self, namespace: str = "", data: Optional[dict] = None) -> None:
        self._data = defaultdict(dict) if data is None else data
        self._namespace = namespace

    def view(self, namespace: str) -> "SharedCache":
        return SharedCache(namespace, self._data)

    def __getitem__(self, key):
        return self._data[self._namespace][key]

    def __setitem__(self, key, value):
        self._data[self._namespace][key] = value

    def __delitem__(self, key):
        del self._data[self._namespace][key]

    def __iter__(self):
        return iter(self._data[self._namespace])

    def __len__(self):
        return len(self._data[self._namespace])


class Rope(nn.Module):
    def __init__(self, cache: SharedCache, namespace: str):
        super().__init__()
        self.cache = cache.view(namespace)

    def warmup(self, n: int) -> None:
        self.cache["sin"] = torch.arange(n).float().sin()


class Blocks(nn.Module):
    def __init__(self, noisy: bool = False):
        super().__init__()
        self.noisy = noisy
        self.proj = nn.Linear(4, 4)
        self.cache = SharedCache()
        self.ropes = nn.ModuleList([Rope(self.cache, "a"), Rope(self.cache, "b")])

    def init_weights(self, max_seq_len: int = 4) -> None:
        nn.init.normal_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)
        for rope in self.ropes:
            rope.warmup(max_seq_len)
        if self.noisy:
            self.ropes[1].cache["noise"] = torch.randn(2)


def test_a_mapping_class_shared_by_modules_gets_real_values():
    with torch.device("meta"):
        model = Blocks()
    keyinit.materialize(model, 0, device="cpu", init_method="init_weights", init_kwargs={"max_seq_len": 5})
    for rope in model.ropes:
        assert type(rope.cache["sin"]) is torch.Tensor
        assert torch.equal(rope.cache["sin"], torch.arange(5).float().sin())
    assert not any(isinstance(v, LazyTensor) for d in model.cache._data.values() for v in d.values())


def test_random_values_in_a_mapping_class_are_a_plan_error_naming_where():
    with torch.device("meta"):
        model = Blocks(noisy=True)
    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"cache\._data\['b'\]\['noise'\].*register_buffer"):
        keyinit.materialize(model, 0, device="cpu", init_method="init_weights")
    assert model.proj.weight.is_meta


def test_a_table_held_in_two_places_becomes_one_real_tensor():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2)

        def init_weights(self):
            nn.init.zeros_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)
            table = torch.arange(3.0)
            self.pair = (table, table * 2)
            self.same_pair = self.pair
            self.tables = [table, table]

    with torch.device("meta"):
        model = Twice()
    keyinit.materialize(model, 0, device="cpu", init_method="init_weights")
    assert model.same_pair is model.pair and model.tables[0] is model.tables[1] is model.pair[0]
    assert torch.equal(model.pair[1], torch.arange(3.0) * 2) and type(model.pair[0]) is torch.Tensor


# ---------------------------------------------------------------- audit of issue 23


class BufferViewsParameter(nn.Module):
    """A buffer that is a view of a parameter's elements (``.data`` or ``.detach()``): the alias the view
    was taken from is alive only as the view's base, not stored anywhere by the constructor."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.arange(6.0).reshape(2, 3))
        alias = self.a.data if how == "data" else self.a.detach()
        self.register_buffer("b", alias[:, :2])


@pytest.mark.parametrize("how", ["data", "detach"])
def test_a_buffer_viewing_a_parameter_is_part_of_the_model_not_an_escaped_tensor(how):
    eager = BufferViewsParameter(how)
    model = keyinit.deferred(BufferViewsParameter, how)  # was a CaptureError: "stored ... outside the model"
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.a, eager.a) and torch.equal(model.b, eager.b)


@functools.lru_cache
def _frequencies(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32).cos()


@functools.lru_cache
def _jitter(n: int) -> torch.Tensor:
    return torch.rand(n)


class InitWithCachedHelper(nn.Module):
    """torchtitan-style init_weights that fills a buffer from a cached helper."""

    def __init__(self, helper) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("freqs", torch.empty(4), persistent=False)
        self.helper = helper

    def init_weights(self) -> None:
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)
        with torch.no_grad():
            self.freqs.copy_(self.helper(4))


@pytest.mark.parametrize("build", ["meta", "eager"])
def test_a_table_init_code_leaves_in_an_lru_cache_is_real_for_later_eager_code(build):
    _frequencies.cache_clear()
    if build == "meta":
        with torch.device("meta"):
            model = InitWithCachedHelper(_frequencies)
        keyinit.materialize(model, 0, device="cpu", init_method="init_weights")
    else:
        model = InitWithCachedHelper(_frequencies)
        keyinit.init_model(model, 0, init_method="init_weights")
    assert torch.equal(model.freqs, torch.arange(4, dtype=torch.float32).cos())
    later = _frequencies(4) + 1  # was a CaptureError: the cache held a stand-in
    assert type(later) is torch.Tensor and torch.equal(later, torch.arange(4, dtype=torch.float32).cos() + 1)


def test_a_draw_init_code_leaves_in_an_lru_cache_is_an_error_naming_it_and_the_cache_is_cleared():
    _jitter.cache_clear()
    with torch.device("meta"):
        model = InitWithCachedHelper(_jitter)
    with pytest.raises(keyinit.UnkeyedRandomnessError, match="lru_cache"):
        keyinit.materialize(model, 0, device="cpu", init_method="init_weights")
    assert model.proj.weight.is_meta and _jitter.cache_info().currsize == 0


@functools.lru_cache
def _cached_noise(n: int) -> torch.Tensor:
    return torch.randn(n)


def _add(module: nn.Module, args: tuple, table: torch.Tensor) -> tuple:
    return (args[0] + table,)


def test_a_cached_draw_viewed_into_a_partial_hook_names_both_holders_and_clears_the_cache():
    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(2, 2)
            self.register_forward_pre_hook(functools.partial(_add, table=_cached_noise(4).reshape(2, 2)))

    _cached_noise.cache_clear()
    with pytest.raises(keyinit.UnkeyedRandomnessError,
                       match=r"Hooked\(\.\.\.\): code stored a tensor .* in a dict in a functools\.partial, "
                             r"a functools\._lru_cache_wrapper;"):
        keyinit.deferred(Hooked)
    assert _cached_noise.cache_info().currsize == 0  # the view was named first and the cache kept its stand-in
    assert type(_cached_noise(4)) is torch.Tensor
