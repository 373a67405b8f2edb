"""Sizes carry the batch: x.shape[0] / x.size(0) size a per-sample draw; len(), int() and numel() are refused."""

from __future__ import annotations

import pytest
import torch

import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError
from tests.nn.stream.test_keyed_golden import Fn


def _split_invariant(fn) -> None:
    model = Fn(fn)
    x = torch.ones(6, 3)
    with knn.keyed(model, 0, step=0):
        whole = model(x)
    with knn.keyed(model, 0, step=0, sample_offset=4):
        assert torch.equal(model(x[4:]), whole[4:])


@pytest.mark.parametrize("fn", [
    lambda x: torch.rand(x.shape[0], 2),
    lambda x: torch.randn(x.size(0), 2),
    lambda x: torch.rand(x.size()),
    lambda x: x.new_empty((x.shape[0], 1)).uniform_(),
    lambda x: torch.empty(*x.shape).exponential_(),
    lambda x: torch.randint(0, 10, (x.shape[0], 3)),
], ids=["shape", "size0", "size", "new_empty", "empty_star", "randint"])
def test_factories_sized_by_the_batch_size_are_keyed_per_sample(fn):
    _split_invariant(fn)


@pytest.mark.parametrize("fn,why", [
    (lambda x: torch.rand(len(x), 2), "as a plain int"),
    (lambda x: torch.rand(int(x.shape[0]), 2), "as a plain int"),
    (lambda x: torch.rand(x.numel()), "arithmetic on the batch size"),
    (lambda x: torch.rand(x.shape[0] * 2), "arithmetic on the batch size"),
], ids=["len", "int", "numel", "product"])
def test_sizes_that_lost_the_fact_are_refused_not_replicated(fn, why):
    with knn.keyed(model := Fn(fn), 0, step=0), pytest.raises(UnkeyedRandomnessError, match="root module") as err:
        model(torch.ones(4, 3))
    assert why in str(err.value)
