"""Replay's run paths (a whole tensor, a row shard, a chunk: consecutive positions) give the values
of its general path (listed positions), bit for bit, for init code that writes one weight in parts.

The fused q/k/v of torchtitan (``cat`` of per-head views of three drawn temporaries, copied into
the weight), slices of one weight drawn one by one, and a ``stack`` are replayed whole (the run
paths of ``keyinit._engine.programs.replay``) and as a shard that lists every row and column in a
shuffled order (positions that are no run: the general path, unravel and per-coordinate boxes);
the two must agree everywhere, also with chunks cut mid-row and row shards cut mid-part.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

import keyinit
from keyinit._engine.programs import replay
from keyinit.layouts import ManualShard

HEADS, HEAD_DIM, COLS = 3, 5, 7
ROWS = 3 * HEADS * HEAD_DIM  # 45


class Parts(nn.Module):
    """One ``(ROWS, COLS)`` weight whose init writes it in parts (``kind``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(ROWS, COLS))
        self.kind = kind

    def init_weights(self) -> None:
        w = self.weight
        with torch.no_grad():
            if self.kind == "fused":  # torchtitan's _fused_qkv_param_init, with 1 q head per kv head
                q, k, v = (w.new_empty(HEADS * HEAD_DIM, COLS) for _ in range(3))
                for part in (q, k, v):
                    nn.init.trunc_normal_(part, std=0.02)
                w.copy_(torch.cat([p.view(HEADS, 1, HEAD_DIM, COLS) for p in (q, k, v)], dim=1).view(-1, COLS))
            elif self.kind == "slices":  # uneven cuts, one a strided slice of columns
                nn.init.trunc_normal_(w[:11], std=0.02)
                nn.init.normal_(w[11:30])
                nn.init.uniform_(w[30:, 1::2])
                w[30:, ::2].zero_()
            elif self.kind == "stack":  # stack along the last dim of three drawn parts
                parts = [nn.init.kaiming_uniform_(w.new_empty(ROWS, 3)) for _ in range(2)] + [w.new_empty(ROWS, 1).normal_()]
                w.copy_(torch.cat([torch.stack([parts[0], parts[1]], dim=2).reshape(ROWS, 6), parts[2]], dim=1))


def _whole(kind: str) -> torch.Tensor:
    module = Parts(kind)
    keyinit.init_model(module, 11, init_method="init_weights")
    return module.weight.detach().clone()


def _shard(kind: str, region: tuple) -> torch.Tensor:
    shard = ManualShard((ROWS, COLS), region)
    module = Parts(kind)
    module.weight = nn.Parameter(torch.empty(shard.region_shape))
    keyinit.init_model(module, 11, init_method="init_weights", shards={"weight": shard})
    return module.weight.detach().clone()


@pytest.mark.parametrize("kind", ["fused", "slices", "stack"])
def test_runs_give_the_general_paths_values(kind):
    whole = _whole(kind)
    generator = torch.Generator().manual_seed(3)
    rows, cols = torch.randperm(ROWS, generator=generator), torch.randperm(COLS, generator=generator)
    listed = _shard(kind, (rows.tolist(), cols.tolist()))  # every element, at no run of positions
    assert torch.equal(listed, whole[rows][:, cols])
    assert torch.equal(_shard(kind, (slice(8, 38), slice(None))), whole[8:38])  # a row shard cut mid-part
    with mock.patch.object(replay, "CHUNK", 37):  # chunks cut mid-row and mid-head
        assert torch.equal(_whole(kind), whole)
        assert torch.equal(_shard(kind, (slice(4, 41), slice(None))), whole[4:41])


def test_fused_parts_are_the_draws_of_their_temporaries():
    """The fused weight's q, k and v rows are three distinct draws, interleaved per head."""
    w = _whole("fused").view(HEADS, 3, HEAD_DIM, COLS)
    q, k, v = (w[:, i].reshape(-1, COLS) for i in range(3))
    assert not torch.equal(q, k) and not torch.equal(k, v) and not torch.equal(q, v)


@pytest.mark.parametrize("size", [1, 9, 40000])
def test_unique_inverse_is_torch_unique(size):
    generator = torch.Generator().manual_seed(size)
    coord = torch.randint(0, size, (500,), generator=generator)
    unique, inverse = replay._unique_inverse(coord, size)
    want_unique, want_inverse = torch.unique(coord, sorted=True, return_inverse=True)
    assert torch.equal(unique, want_unique) and torch.equal(inverse, want_inverse)
