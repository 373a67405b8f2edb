"""keyinit.nn.keyed nested on a submodule, and a keyed model's forward in another thread."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import keyinit
import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError
from keyinit.nn import dropout_key
from tests._support.nets import linear_dropout



class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.d = linear_dropout(4, 0.5)

    def forward(self, x):
        return self.d(x)


def test_a_nested_keyed_on_a_submodule_keys_it_by_its_fqn_in_the_outer_model():
    model, x = _Outer().train(), torch.ones(6, 4)
    with knn.keyed(model, 1, step=2, sample_offset=3, stream="v1"):
        alone = model(x)
    with knn.keyed(model, 1, step=2, sample_offset=3, stream="v1"):
        with knn.keyed(model.d, 1, step=2, sample_offset=3, stream="v1"):  # the same values: keys nothing more
            nested = model(x)
            inner_only = model.d(x)  # d's forward outside the outer's: still keyed by the outer, as 'd'
    assert torch.equal(nested, alone) and torch.equal(inner_only, alone)
    keep = keyinit.random.bernoulli(dropout_key(1, step=2, fqn="d.1", ordinal=0), (9, 4), p=0.5, region=(slice(3, 9), slice(None)))
    assert torch.equal(alone != 0, keep & (model.d[0](x) != 0))
    with knn.keyed(model, 1, step=2, stream="v1"):
        with pytest.raises(RuntimeError, match=r"module is 'd'.*Remove the inner keyed"):
            with knn.keyed(model.d, 1, step=3, stream="v1"):
                pass
    with knn.keyed(model.d, 1, step=2, stream="v1"):
        with pytest.raises(RuntimeError, match="enter keyinit.nn.keyed once, on the whole model"):
            with knn.keyed(model, 1, step=2, stream="v1"):
                pass
    assert not model.d[1]._forward_pre_hooks and not model._forward_pre_hooks


def test_a_forward_in_another_thread_is_refused_not_left_to_torch():
    model, x = _Outer().train(), torch.ones(6, 4)
    errors: list = []

    def forward():
        try:
            model(x)
        except UnkeyedRandomnessError as exc:
            errors.append(exc)

    rng = torch.get_rng_state()
    with knn.keyed(model, 1, step=2):
        thread = threading.Thread(target=forward, name="replica-1")
        thread.start()
        thread.join()
        assert len(errors) == 1 and "module 'd.1' (Dropout)" in str(errors[0])
        assert "'replica-1'" in str(errors[0]) and "another thread" in str(errors[0])
        model.eval()  # no draw: an eval forward in another thread runs
        thread = threading.Thread(target=forward)
        thread.start()
        thread.join()
        assert len(errors) == 1
        model.train()
        mine = model(x)  # the entering thread is keyed as before
    assert torch.equal(rng, torch.get_rng_state())
    with knn.keyed(model, 1, step=2):
        assert torch.equal(model(x), mine)
