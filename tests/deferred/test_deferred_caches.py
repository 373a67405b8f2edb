"""``keyinit.deferred`` with a constructor that keeps a ``functools.lru_cache`` helper's table as a model
tensor (issue 34): the cache holds the same object the model registered, so after the build it must hold
the table's real values, not a stand-in (the model's forward and a later eager build call the helper)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import keyinit
from keyinit.errors import UnkeyedRandomnessError


def _rotary(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    return torch.cos(angles), torch.sin(angles)


rotary = functools.lru_cache(_rotary)


@functools.lru_cache
def cached_noise(n: int) -> torch.Tensor:
    return torch.randn(n)


class Attention(nn.Module):
    """Registers the cached tables (or a view of them) as buffers; ``scale`` writes into them in place."""

    def __init__(self, how: str = "buffer", scale: float = 1.0) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        cos, sin = rotary(8, 4)
        if how == "view":
            cos, sin = cos[:6], sin[:6]
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        if scale != 1.0:
            self.cos.mul_(scale)  # eager torch: the cache's table changes too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(8, 4)  # the cache again, as RoPE helpers do at each forward
        y = self.proj(x)
        return y * cos[: x.shape[0], :1] + sin[: x.shape[0], 1:] + self.cos[0, 0]


class Net(nn.Module):
    def __init__(self, how: str = "buffer", scale: float = 1.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention(how, scale) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture(autouse=True)
def _fresh_caches():
    rotary.cache_clear()
    cached_noise.cache_clear()
    yield
    rotary.cache_clear()
    cached_noise.cache_clear()


def _eager_tables(how: str, scale: float) -> tuple[torch.Tensor, ...]:
    """What eager torch leaves in the cache and in the model's buffers after building ``Net(how, scale)``."""
    rotary.cache_clear()
    net = Net(how, scale)
    out = tuple(t.clone() for t in rotary(8, 4)) + tuple(b.clone() for b in net.buffers())
    rotary.cache_clear()
    return out


@pytest.mark.parametrize("how,scale", [("buffer", 1.0), ("view", 1.0), ("buffer", 2.0)])
def test_the_cache_entry_holds_the_real_table_eager_torch_would(how, scale):
    want = _eager_tables(how, scale)
    state = torch.get_rng_state()
    model = keyinit.deferred(Net, how, scale)
    entry = rotary(8, 4)  # (c): before and after materialize
    assert all(type(t) is torch.Tensor for t in entry)
    for got, expected in zip(entry, want[:2]):
        assert torch.equal(got, expected)
    keyinit.materialize(model, seed=0, device="cpu")
    assert torch.equal(torch.get_rng_state(), state)
    for got, expected in zip(list(model.buffers()), want[2:]):
        assert got.device.type == "cpu" and torch.equal(got, expected)
    assert rotary.cache_info().misses == 1  # the constructor's entry, not computed again


def test_the_deferred_model_runs_its_forward_after_materialize():
    model = keyinit.deferred(Net)
    keyinit.materialize(model, seed=0, device="cpu")
    x = torch.ones(3, 4)
    out = model(x)  # (a): its forward calls the cache again
    cos, sin = _rotary(8, 4)
    expect = x
    for block in model.blocks:
        expect = block.proj(expect) * cos[:3, :1] + sin[:3, 1:] + cos[0, 0]
    torch.testing.assert_close(out, expect)  # torch's own matmul: a tolerance


def test_a_later_eager_build_of_the_same_class_shares_the_real_table():
    keyinit.deferred(Net)
    eager = Net()  # (b): the constructor gets the cache's entry
    assert eager.blocks[0].cos is rotary(8, 4)[0] and eager.blocks[1].cos is rotary(8, 4)[0]
    assert torch.equal(eager.blocks[0].cos, _rotary(8, 4)[0])
    assert eager(torch.ones(2, 4)).shape == (2, 4)
    again = keyinit.deferred(Net)  # and another deferred build of it (the cache now holds a real tensor)
    keyinit.materialize(again, seed=0, device="cpu")
    assert torch.equal(again.blocks[1].sin, _rotary(8, 4)[1]) and again(torch.ones(2, 4)).shape == (2, 4)


class NoisyBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("noise", cached_noise(3))


def test_a_cached_draw_kept_as_a_buffer_is_an_error_naming_it_and_the_cache_and_the_cache_is_cleared():
    state = torch.get_rng_state()
    with pytest.raises(UnkeyedRandomnessError,
                       match=r"NoisyBuffer\(\.\.\.\): noise \(shape \(3,\)\) holds random draws and is also held by "
                             r"the functools\.lru_cache of tests\.deferred\.test_deferred_caches\.cached_noise; .*draw the "
                             r"tensor in the constructor without caching it"):
        keyinit.deferred(NoisyBuffer)
    assert torch.equal(torch.get_rng_state(), state)
    assert cached_noise.cache_info().currsize == 0
    assert type(NoisyBuffer().noise) is torch.Tensor  # a later eager build draws as usual


def test_only_model_tensors_something_else_holds_are_given_values(monkeypatch):
    from keyinit._engine.capture import escape

    found = []
    real = escape._shared_model_tensors

    def spy(*args):
        shared = real(*args)
        found.append([fqn for fqn, _ in shared])
        return shared

    monkeypatch.setattr(escape, "_shared_model_tensors", spy)
    model = keyinit.deferred(lambda: nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), Attention()))
    # the cache holds the table behind 2.cos and 2.sin; no other tensor is computed (a walk of the whole
    # model would make every tensor of a large model real)
    assert found == [["2.cos", "2.sin"]]
    assert all(t.device.type == "meta" for t in model.state_dict().values())
