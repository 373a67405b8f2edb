"""Shared test helpers for the stream v1 core.

Tests that take a ``sampler`` argument are run once per (distribution, parameter
setting, dtype) in :data:`CASES`, and tests that take ``base_sampler`` once per
distribution (:data:`BASE_CASES`; see :func:`pytest_generate_tests`), so adding
a distribution here covers it in every region/dtype property test.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any, Callable

import attrs
import numpy as np
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # make `pytest` work without installing keyinit
    sys.path.insert(0, str(ROOT))

import keyinit  # noqa: E402
from keyinit import random as kr  # noqa: E402
from tests._support.vision import define_torchvision_schemas  # noqa: E402

# transformers, timm and open_clip import torchvision when it is installed; the wheel served
# here cannot load its C++ ops beside CPU torch (see tests/_support/vision.py).
define_torchvision_schemas()

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

_BIT_VIEW = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.bool: torch.uint8,
}


def bit_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bit patterns as an integer tensor (floats), or itself (ints).

    Comparing bit views with ``torch.equal`` is bit-exact: it tells ``0.0`` from
    ``-0.0`` and would not be fooled by NaN.
    """
    target = _BIT_VIEW.get(tensor.dtype)
    if target is None:
        return tensor
    return tensor.contiguous().view(target)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert tuple(actual.shape) == tuple(expected.shape), (tuple(actual.shape), tuple(expected.shape))
    if not torch.equal(bit_view(actual), bit_view(expected)):
        diff = (bit_view(actual) != bit_view(expected)).nonzero()
        raise AssertionError(f"{diff.shape[0]} elements differ, first at {diff[:5].tolist()}")


def ix_numpy(shape: tuple[int, ...], region: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
    """numpy.ix_ of ``region`` against ``shape``, computed without keyinit.regions."""
    index_lists = []
    for entry, size in zip(region, shape):
        if isinstance(entry, slice):
            index_lists.append(np.arange(size, dtype=np.int64)[entry])
        elif isinstance(entry, torch.Tensor):
            index_lists.append(entry.numpy().astype(np.int64))
        else:
            index_lists.append(np.asarray(list(entry), dtype=np.int64).reshape(-1))
    return np.ix_(*index_lists)


def index_full(full: torch.Tensor, region: tuple[Any, ...]) -> torch.Tensor:
    """``full[region]`` with numpy.ix_ semantics, on the bit view (numpy has no bfloat16)."""
    if full.dim() == 0:
        return full.clone()
    bits = bit_view(full).numpy()
    picked = np.ascontiguousarray(bits[ix_numpy(tuple(full.shape), region)])
    as_torch = torch.from_numpy(picked)
    if full.dtype in _BIT_VIEW:
        as_torch = as_torch.view(full.dtype)
    return as_torch


@attrs.frozen
class Case:
    """One sampler with one parameter setting and one dtype."""

    name: str
    sampler: Callable[..., torch.Tensor]
    kwargs: dict
    dtype: torch.dtype
    words_per_element: int

    def __call__(self, key: keyinit.Key, shape: Any, **extra: Any) -> torch.Tensor:
        return self.sampler(key, shape, dtype=self.dtype, **self.kwargs, **extra)

    @property
    def id(self) -> str:
        params = ",".join(f"{k}={v}" for k, v in self.kwargs.items())
        return f"{self.name}({params})-{str(self.dtype).replace('torch.', '')}"


_SETTINGS: list[tuple[str, Callable[..., torch.Tensor], dict, tuple[torch.dtype, ...], int]] = [
    ("bits", kr.bits, {}, (torch.int64,), 1),
    ("uniform", kr.uniform, {}, FLOAT_DTYPES, 1),
    ("uniform", kr.uniform, {"low": -3.0, "high": 0.5}, (torch.float32,), 1),
    ("normal", kr.normal, {}, FLOAT_DTYPES, 1),
    ("normal", kr.normal, {"mean": 1.5, "std": 0.02}, (torch.float32, torch.bfloat16), 1),
    ("truncated_normal", kr.truncated_normal, {}, FLOAT_DTYPES, 1),
    ("truncated_normal", kr.truncated_normal, {"mean": 0.0, "std": 1.0, "a": 0.5, "b": 4.0}, (torch.float32,), 1),
    ("bernoulli", kr.bernoulli, {}, (torch.bool, *FLOAT_DTYPES, *INT_DTYPES), 1),
    ("bernoulli", kr.bernoulli, {"p": 0.1}, (torch.bool,), 1),
    ("randint", kr.randint, {"low": 0, "high": 10}, INT_DTYPES, 2),
    ("randint", kr.randint, {"low": -(2**31), "high": 2**31}, (torch.int64, torch.int32), 2),
    ("randint", kr.randint, {"low": 0, "high": 2**32}, (torch.int64,), 2),
]

CASES: list[Case] = [
    Case(name, sampler, kwargs, dtype, w)
    for name, sampler, kwargs, dtypes, w in _SETTINGS
    for dtype in dtypes
]

#: One f32 (or default-dtype) case per distribution, for the costlier tests.
BASE_CASES: list[Case] = [c for c in CASES if not any(d.name == c.name for d in CASES[: CASES.index(c)])]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    explicit = {name for marker in metafunc.definition.iter_markers("parametrize")
                for name in (marker.args[0].split(",") if isinstance(marker.args[0], str) else marker.args[0])}
    for name, cases in (("sampler", CASES), ("base_sampler", BASE_CASES)):
        if name in metafunc.fixturenames and name.strip() not in {n.strip() for n in explicit}:
            metafunc.parametrize(name, cases, ids=[c.id for c in cases])


@pytest.fixture(scope="session", autouse=True)
def one_intra_op_thread():
    """Run the suite with one torch thread.

    Values never depend on the thread count (test_random_properties checks 1 vs 2
    explicitly), and on a shared 2-core machine OpenMP with 2 threads under
    oversubscription runs the big draws over 10x slower than one thread.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def restore_threads():
    """Restore torch's intra-op thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
