"""Hostile and careless input, round 5 (issue 34): the smaller cases, each a clear error or the right values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import keyinit


# ---------------------------------------------------------------- 1. Plan.values with int region entries


def test_plan_values_int_entries_index_like_the_whole_tensor():
    with torch.device("meta"):
        model = nn.Linear(4, 5)
    plan = keyinit.plan_init(model, 0)
    full = plan.values("weight")
    assert torch.equal(plan.values("weight", (3, slice(None))), full[3, :])
    assert torch.equal(plan.values("weight", (slice(1, 4), -1)), full[1:4, -1])
    assert torch.equal(plan.values("weight", (np.int64(2), torch.tensor(1))), full[2, 1])
    assert plan.values("weight", (-5, 0)).shape == ()
    assert torch.equal(plan.values("weight", ([3], slice(None))), full[[3], :])  # a list keeps the dimension
    with pytest.raises(ValueError, match=r"weight: bad region .*region entry 0 has index 5, out of bounds for size 5"):
        plan.values("weight", (5, slice(None)))
    with pytest.raises(ValueError, match=r"weight: bad region .*region entry 0 must be .* got bool"):
        plan.values("weight", (True, slice(None)))
