"""No public keyinit call reads or changes global RNG state (torch, numpy, random)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import keyinit
try:  # tests/ as a package (tests/__init__.py) or as a plain directory
    from tests.conftest import CASES, assert_bits_equal
except ImportError:
    from conftest import CASES, assert_bits_equal
from keyinit import random as kr

K = keyinit.key_for(5, "layers.0.attention.wq.weight")
REGION = (slice(None, None, -2), [0, 4, -1])


def _calls():
    yield "key", lambda: keyinit.key(123)
    yield "key stream", lambda: keyinit.key(2**64 - 1, stream="v1")
    yield "Key", lambda: keyinit.Key(1, 2)
    yield "split", lambda: keyinit.split(K, 5)
    yield "fold_in int", lambda: keyinit.fold_in(K, 7)
    yield "fold_in str", lambda: keyinit.fold_in(K, "weight")
    yield "key_for seed", lambda: keyinit.key_for(3, "a.b.c")
    yield "key_for key", lambda: keyinit.key_for(K, "a.b.c")
    for case in CASES:
        yield case.id, lambda case=case: case(K, (7, 5))
        yield case.id + " region", lambda case=case: case(K, (7, 5), region=REGION)
        yield case.id + " out", lambda case=case: case(K, (7, 5), out=torch.empty(5, 7, dtype=case.dtype).T)
    yield "sample", lambda: kr.sample(keyinit.distributions.Normal.create(0, 1), K, (4,))
    yield "failing call", _failing_call


def _failing_call():
    with pytest.raises(ValueError):
        kr.normal(K, (3,), std=-1.0)


CALLS = list(_calls())


def _states():
    return torch.get_rng_state().clone(), np.random.get_state(), random.getstate(), torch.initial_seed()


@pytest.mark.parametrize("name, call", CALLS, ids=[name for name, _ in CALLS])
def test_call_leaves_global_rng_state_alone(name, call):
    torch.manual_seed(1234)
    np.random.seed(99)
    random.seed(7)
    torch_before, numpy_before, python_before, seed_before = _states()
    call()
    torch_after, numpy_after, python_after, seed_after = _states()
    assert torch.equal(torch_before, torch_after), name
    assert seed_before == seed_after
    assert numpy_before[0] == numpy_after[0] and np.array_equal(numpy_before[1], numpy_after[1])
    assert numpy_before[2:] == numpy_after[2:]
    assert python_before == python_after


def test_global_sequence_continues_as_if_keyinit_was_not_called():
    torch.manual_seed(0)
    expected = torch.rand(8)
    torch.manual_seed(0)
    for _, call in CALLS:
        call()
    assert torch.equal(torch.rand(8), expected)


def test_values_do_not_depend_on_global_seed():
    for seed in (0, 1):
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        draws = [case(K, (7, 5), region=REGION) for case in CASES]
        if seed == 0:
            first = draws
    for a, b in zip(first, draws):
        assert_bits_equal(a, b)
