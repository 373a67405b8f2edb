"""torch's pruning in a deferred constructor beyond one call (issue 23): ``global_unstructured`` keeps the mask
it computes from the drawn weights in its hooks, and iterative pruning computes its second mask from values
known only once keyed: each is a clear UnkeyedRandomnessError naming what needs them and what to do (prune
after materialize). Indexing a drawn tensor with a mask whose values are known (how torch's pruning
container selects) is recorded, and equal on shards."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import keyinit
from keyinit.layouts import ManualShard


class GloballyPruned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(6, 4)
        prune.global_unstructured([(self.a, "weight"), (self.b, "weight")], pruning_method=prune.L1Unstructured,
                                  amount=0.3)


def test_global_pruning_in_a_constructor_is_refused_naming_the_hook_that_keeps_the_mask():
    # global_unstructured leaves its mask, computed from the drawn weights, in each CustomFromMask hook
    # (outside the model's tensors, where no key reaches): a clear error, not "register it as a buffer"
    with pytest.raises(keyinit.UnkeyedRandomnessError,
                       match=r"GloballyPruned\(\.\.\.\): .*attribute mask of a torch\.nn\.utils\.prune\.CustomFromMask"
                             r".*prune after materialize"):
        keyinit.deferred(GloballyPruned)


def test_global_pruning_after_materialize_is_eager_torchs():
    model = nn.Module()  # the layers alone, pruned once they hold their keyed values
    model.a, model.b = keyinit.deferred(nn.Linear, 8, 6), keyinit.deferred(nn.Linear, 6, 4)
    keyinit.materialize(model, 0, device="cpu")
    prune.global_unstructured([(model.a, "weight"), (model.b, "weight")], pruning_method=prune.L1Unstructured,
                              amount=0.3)
    weights = torch.cat([model.a.weight_orig.detach().flatten(), model.b.weight_orig.detach().flatten()])
    masks = torch.cat([model.a.weight_mask.flatten(), model.b.weight_mask.flatten()])
    assert int((masks == 0).sum()) == round(0.3 * weights.numel())


class SelectsRows(nn.Module):
    """Boolean and integer indexing of a drawn weight with a mask whose values are known."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(6, 3))
        nn.init.normal_(self.w)
        even = torch.arange(6) % 2 == 0
        self.register_buffer("even_rows", self.w.detach()[even] * 2)  # was refused: "uses the values"
        self.register_buffer("picked", self.w.detach()[torch.tensor([4, 0])])
        with torch.no_grad():
            self.w[~even] = 0.0


def test_indexing_a_drawn_tensor_with_a_known_mask_is_recorded_and_equal_on_shards():
    model = keyinit.deferred(SelectsRows)
    keyinit.materialize(model, 0, device="cpu")
    w = model.w.detach()
    assert bool((w[1::2] == 0).all()) and bool((w[::2] != 0).all())
    assert torch.equal(model.even_rows, w[::2] * 2) and torch.equal(model.picked, w[[4, 0]])
    shard = keyinit.deferred(SelectsRows)
    shard.even_rows = torch.empty(2, 3, device="meta")
    keyinit.materialize(shard, 0, device="cpu", shards={"even_rows": ManualShard((3, 3), (slice(1, 3), slice(None)))})
    assert torch.equal(shard.even_rows, model.even_rows[1:3]) and torch.equal(shard.w, model.w)


class PrunedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 6)
        prune.l1_unstructured(self.lin, "weight", amount=0.2)
        prune.l1_unstructured(self.lin, "weight", amount=0.2)  # prunes among the weights the first mask kept


def test_iterative_pruning_in_a_constructor_is_refused_naming_the_op_and_what_to_do():
    with pytest.raises(keyinit.UnkeyedRandomnessError,
                       match=r"PrunedTwice\(\.\.\.\): init code uses the values of a tensor in Python \(index\.Tensor\)"
                             r".*known only when .* keyed.*after materialize"):
        keyinit.deferred(PrunedTwice)
