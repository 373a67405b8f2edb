"""keyed_samples' fast path (random ops intercepted by dispatch key, common draws keyed without a
program) gives exactly the values of the general path (a dispatch mode seeing every op, every draw
through the program of keyinit._engine.programs.random_ops): the stream of existing keyed values is unchanged."""

from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest
import torch

from keyinit._engine.keyed import intercept as _intercept
from keyinit._engine.programs import fast_recipes
from keyinit.data import _fast, _fill, keyed_samples


class _Many(torch.utils.data.Dataset):
    """Every op and overload the fast path recognizes, and some it does not (general path inside)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(3)
        p = torch.linspace(0.0, 1.0, 7)
        out = [
            torch.rand(3), torch.rand(2, 2, dtype=torch.float64), torch.rand(4, generator=g),
            torch.randn(5), torch.randn(3, dtype=torch.bfloat16, generator=g),
            torch.rand_like(torch.zeros(2, 3, dtype=torch.float16)), torch.randn_like(torch.zeros(4)),
            torch.randint(7, (3,)), torch.randint(-5, 5, (2, 2), dtype=torch.int32),
            torch.randint(0, 2**32, (3,)), torch.randint(3, 9, (4,), generator=g, dtype=torch.float32),
            torch.randint_like(torch.zeros(3, dtype=torch.int16), 40), torch.randint_like(torch.zeros(3), 2, 9),
            torch.randperm(9), torch.randperm(5, dtype=torch.int32, generator=g),
            torch.empty(3).uniform_(), torch.empty(2, 2, dtype=torch.float64).uniform_(-2, 3),
            torch.empty(2).uniform_(1.5, 1.5), torch.empty(3).normal_(), torch.empty(4).normal_(2.0, 0.5, generator=g),
            torch.empty(3, dtype=torch.int32).random_(), torch.empty(3, dtype=torch.int64).random_(10),
            torch.empty(3, dtype=torch.uint8).random_(3, 200), torch.empty(2).random_(0, 50),
            torch.empty(5).bernoulli_(0.3), torch.empty(7).bernoulli_(p), torch.bernoulli(p),
            torch.bernoulli(p.double(), generator=g), torch.bernoulli(torch.zeros(3), 0.75),
            torch.empty(6)[::2].uniform_(), torch.zeros(2, 3).t().normal_(),  # strided targets
            torch.multinomial(torch.ones(5), 3), torch.empty(3).exponential_(), torch.normal(torch.zeros(3), 2.0),
        ]
        return out + [random.random(), float(np.random.rand())]


def _general(monkeypatch):
    monkeypatch.setattr(_intercept, "available", lambda: False)
    monkeypatch.setattr(_fast, "plan", lambda *a, **k: None)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), (x, y)
        else:
            assert x == y


def test_fast_path_values_equal_the_general_path(monkeypatch):
    fast = [keyed_samples(_Many(), 11)[(i, e)] for i, e in ((0, 0), (5, 2))]
    assert _intercept.available()
    with monkeypatch.context() as m:
        _general(m)
        general = [keyed_samples(_Many(), 11)[(i, e)] for i, e in ((0, 0), (5, 2))]
    for a, b in zip(fast, general):
        _same(a, b)


def test_outside_a_keyed_call_random_ops_are_torch_s():
    _intercept.available()
    torch.manual_seed(5)
    want = torch.rand(3), torch.empty(2).uniform_(), torch.bernoulli(torch.full((4,), 0.5))
    torch.manual_seed(5)
    got = torch.rand(3), torch.empty(2).uniform_(), torch.bernoulli(torch.full((4,), 0.5))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision is not installed")
def test_torchvision_pipeline_fast_equals_general(monkeypatch):
    from tests.data.test_data_augment import _Vision

    fast = [keyed_samples(_Vision(), 11)[(i, 1)][0] for i in range(4)]
    with monkeypatch.context() as m:
        _general(m)
        general = [keyed_samples(_Vision(), 11)[(i, 1)][0] for i in range(4)]
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(fast, general))


class _NumpyDraws(torch.utils.data.Dataset):
    def __init__(self, draw):
        self.draw = draw

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.draw()


@pytest.mark.parametrize("draw", [lambda: torch.rand(1), lambda: np.random.rand(), lambda: np.random.randn(),
                                  lambda: (np.random.randn(), np.random.randn())])
def test_numpy_state_is_put_back_exactly_whatever_it_held(draw):
    """The state is put back by copying its bytes where that is exact, else by set_state: either way the
    caller's state (a cached Gaussian included) is unchanged, and the sample's values do not depend on it."""
    values = []
    for prepare in (lambda: None, np.random.randn, lambda: np.random.seed(9), lambda: np.random.rand(700)):
        prepare()
        before = np.random.get_state(legacy=False)
        values.append(keyed_samples(_NumpyDraws(draw), 0)[(1, 0)])
        after = np.random.get_state(legacy=False)
        assert after["has_gauss"] == before["has_gauss"] and after["gauss"] == before["gauss"]
        assert after["state"]["pos"] == before["state"]["pos"]
        assert np.array_equal(after["state"]["key"], before["state"]["key"])
    assert all(repr(v) == repr(values[0]) for v in values)


def test_a_cached_gaussian_set_without_a_draw_is_kept():
    """set_state may change only the cached Gaussian (same words and position): nothing may assume it."""
    np.random.seed(1)
    data = keyed_samples(_NumpyDraws(lambda: torch.rand(1)), 0)
    data[(0, 0)]
    state = np.random.get_state(legacy=False)
    np.random.set_state({**state, "has_gauss": 1, "gauss": 0.5})
    data[(1, 0)]
    after = np.random.get_state(legacy=False)
    assert after["has_gauss"] == 1 and after["gauss"] == 0.5


def test_fast_folds_equal_fold_in():
    import keyinit

    for seed in (0, 1, 2**64 - 1, 123456789):
        k = keyinit.key(seed)
        for data in (0, 1, 2**31, 2**32 - 1, 2**32, 2**63 + 5, 2**64 - 1):
            assert _fill.fold(k, data) == keyinit.fold_in(k, data)
        for text in ("python.random", "numpy.random", "", "é"):
            assert _fill.fold_str(k, text) == keyinit.fold_in(k, text)
        assert _fill.draw_key(k, 3, 1) == keyinit.fold_in(keyinit.fold_in(k, 3), 1)


def test_folds_in_c_equal_fold_in():
    import keyinit

    lib = _fill.kernel_library()
    assert lib is not None
    for seed in (0, 2**64 - 1, 123456789):
        k = keyinit.key(seed)
        for data in (0, 2**32 - 1, 2**32, 2**64 - 1, "python.random", "numpy.random", "é"):
            want = keyinit.fold_in(k, data)
            assert _fill.fold_words(lib, k, data) == want.words == _fill.fold_words(None, k, data)
            assert _fill.fold_with(lib, k, data) == want
    with pytest.raises(ValueError, match=r"fold_in data must be an int in \[0, 2\*\*64\), got -1"):
        _fill.fold_words(lib, keyinit.key(0), -1)


@pytest.mark.parametrize("n", [1, 5, 1031, 1 << 17])
def test_fill_folded_equals_the_fill_under_the_folded_key(n):
    """keyinit_fill_folded: the two folds in C, then the contiguous fill (threads for large n)."""
    import keyinit
    from keyinit.distributions import Bernoulli, Normal, Randint, Uniform

    lib, k = _fill.kernel_library(), keyinit.key(9)
    for dist, dtype in ((Uniform.create(-2.0, 3.0), torch.float32), (Normal.create(0.0, 1.0), torch.bfloat16),
                        (Randint.create(-9, 2**31, torch.int64), torch.int64), (Bernoulli.create(0.25), torch.bool)):
        got, want, python = (torch.zeros(n, dtype=dtype) for _ in range(3))
        _fill.fill_folded(lib, got, dist, k, 7, 2**40)
        _fill.fill(lib, want, dist, keyinit.fold_in(keyinit.fold_in(k, 7), 2**40))
        _fill.fill_folded(None, python, dist, k, 7, 2**40)  # the reference, folds in Python
        assert torch.equal(got, want) and torch.equal(got, python)


def test_small_randperm_sorts_like_the_two_stable_argsorts():
    """Up to 16 positions are ordered in Python: by (hi, lo), ties by position, as the argsorts do."""
    g = torch.Generator().manual_seed(0)
    for n in list(range(0, 18)) + [40]:
        for _ in range(50):
            hi, lo = torch.randint(0, 3, (n,), generator=g), torch.randint(0, 3, (n,), generator=g)
            order = torch.argsort(lo, stable=True)
            want = order[torch.argsort(hi[order], stable=True)]
            for dtype in (torch.int64, torch.int32):
                got = fast_recipes._randperm(n, dtype)[1]([hi, lo])
                assert got.dtype == dtype and torch.equal(got, want.to(dtype))


class _InPlace(torch.utils.data.Dataset):
    def __init__(self, target):
        self.target = target

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return self.target.uniform_(1.0, 2.0)


def test_in_place_draws_write_the_target_and_bump_its_version_once():
    target = torch.zeros(5)
    version = target._version
    out = keyed_samples(_InPlace(target), 3)[(1, 0)]
    assert out is target and target._version == version + 1
    fresh = keyed_samples(_InPlace(torch.zeros(10)[::2]), 3)[(1, 0)]  # strided: drawn, then copied
    assert torch.equal(out, fresh)
    with torch.inference_mode():
        frozen = torch.zeros(5)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        keyed_samples(_InPlace(frozen), 3)[(1, 0)]
