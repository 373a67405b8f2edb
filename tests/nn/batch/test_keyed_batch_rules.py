"""The batch rules of keyed() on the layouts real models use (keyinit/nn/_batch/rules_*.py, issue 22).

Each case runs a small forward that lays the batch out one way and then drops it, on a batch of 4,
on rows 0:2 and 2:4 (``sample_offset`` 0 and 2) and on each row alone: the masks must be bitwise the
same. The cases
where the sample of an element is decided by values keyed() does not follow must raise
``UnkeyedRandomnessError`` instead.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError


class Fn(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _masks(fn, x: torch.Tensor, join: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The dropout mask (``out == 0``) of the whole batch, and of its halves joined along ``join``.

    The forwards of one row each (a batch of one, where a size-1 dimension is both the batch and a
    broadcast) must give the halves' masks too."""
    model = Fn(fn)
    with knn.keyed(model, 3, step=1):
        whole = model(x) == 0
    joined = []
    for split in (((0, 2), (2, 4)), ((0, 1), (1, 2), (2, 3), (3, 4))):
        parts = []
        for lo, hi in split:
            with knn.keyed(model, 3, step=1, sample_offset=lo):
                parts.append(model(x[lo:hi]) == 0)
        joined.append(torch.cat(parts, join))
    assert torch.equal(joined[1], joined[0]), "forwards of one row draw other masks than forwards of two"
    return whole, joined[0]


X = torch.rand(4, 6, 8, generator=torch.Generator().manual_seed(0)) + 0.5  # (B, L, D), no zeros


def _chunks(x: torch.Tensor) -> torch.Tensor:
    """Longformer's overlapping chunks: (B*H, L, d) viewed as (B*H, chunks, 2w, d) by as_strided."""
    b, length, d = x.shape
    x = x.reshape(b, length, 2, d // 2).transpose(1, 2).reshape(b * 2, length, d // 2).contiguous()
    w = 2
    size = (x.shape[0], length // w - 1, 2 * w, x.shape[2])
    stride = (x.stride(0), w * x.stride(1), x.stride(1), x.stride(2))
    return F.dropout(x.as_strided(size, stride), 0.5)


def test_as_strided_chunks_of_a_contiguous_tensor_keep_the_batch():
    whole, halves = _masks(_chunks, X)
    assert torch.equal(whole, halves)


def test_index_by_arange_over_the_batch_picks_each_samples_own_rows():
    def own_rows(x):
        b = x.shape[0]
        rows = torch.arange(b)[:, None]  # a factory sized by the batch size: dimension 0 is the batch
        cols = torch.arange(x.shape[1])[None, :].flip(-1)
        return F.dropout(x[rows, cols], 0.5)

    whole, halves = _masks(own_rows, X)
    assert torch.equal(whole, halves)

    # rows picked by values (keyinit.nn._batch.routed): the dropout of the picked rows is the picked rows of the dropout
    def pick_then_drop(x):
        return F.dropout(x[x[:, 0, 0].argsort()], 0.5)

    def drop_then_pick(x):
        return F.dropout(x, 0.5)[x[:, 0, 0].argsort()]

    outs = []
    for fn in (pick_then_drop, drop_then_pick):
        with knn.keyed(model := Fn(fn), 0, step=0):
            outs.append(model(X))
    assert torch.equal(outs[0], outs[1])


def test_scatter_keeps_rows_along_another_dimension_and_refuses_the_batch_one():
    def gates(x):
        top = x.topk(2, dim=-1).indices  # (B, L, 2)
        flat = top.reshape(-1, 2)  # (B*L, 2): the batch merged with the tokens
        one_hot = torch.zeros(flat.shape[0], x.shape[-1]).scatter(1, flat, 1.0)  # zeros(B*L, D): unplaced
        return F.dropout(one_hot + 1.0, 0.5)

    whole, halves = _masks(gates, X)
    assert torch.equal(whole, halves)

    def into_x(x):
        index = torch.zeros(1, x.shape[1], x.shape[2], dtype=torch.long)
        return F.dropout(x.scatter(0, index, 1.0), 0.5)

    whole, halves = _masks(into_x, X)  # scatter INTO the batch-holding x along its batch: x's layout, kept
    assert torch.equal(whole, halves)

    def out_of_x(x):
        index = torch.zeros(4, 6, 8, dtype=torch.long)
        return F.dropout(torch.zeros(4, 6, 8).scatter(0, index, x), 0.5)

    with knn.keyed(model := Fn(out_of_x), 0, step=0), pytest.raises(UnkeyedRandomnessError, match="by index"):
        model(X)  # rows of the batch written by index into a tensor that holds none


def test_stack_cat_and_an_expanded_replicated_tensor_hold_the_batch():
    def layout(x):
        pos = model.pos
        cls = pos[:, :1].expand(x.shape[0], -1, -1)  # a class token expanded to the batch size
        seq = torch.cat([cls, x], dim=1)  # replicated piece joined along the sequence
        both = torch.stack([seq, seq * 2], dim=1)  # (B, 2, L+1, D)
        rows = torch.stack([x[i] for i in range(x.shape[0])])  # one selected sample per piece
        return F.dropout(both, 0.5), F.dropout(rows, 0.5), F.dropout(pos.expand(x.shape[0], -1, -1), 0.5)

    model = Fn(layout)
    model.register_buffer("pos", torch.rand(1, 6, 8, generator=torch.Generator().manual_seed(1)))
    with knn.keyed(model, 0, step=0):
        whole = model(X)
    parts = []
    for lo, hi in ((0, 2), (2, 4)):
        with knn.keyed(model, 0, step=0, sample_offset=lo):
            parts.append(model(X[lo:hi]))
    for k in range(3):
        assert torch.equal(torch.cat([p[k] for p in parts]) == 0, whole[k] == 0), k


def test_a_constant_tensor_sized_by_arithmetic_takes_the_layout_it_is_added_to():
    def scores(x):
        b, length, d = x.shape
        q = x.reshape(b, length, 2, d // 2).transpose(1, 2).reshape(b * 2, length, d // 2)
        base = torch.zeros(b * 2, length, length)  # GPT-NeoX-Japanese: baddbmm's bias
        return F.dropout(torch.baddbmm(base, q, q.transpose(1, 2)).softmax(-1), 0.5)

    whole, halves = _masks(scores, X)
    assert torch.equal(whole, halves)
    with knn.keyed(model := Fn(lambda x: F.dropout(torch.rand(x.shape[0] * 2, 3), 0.5)), 0, step=0), \
            pytest.raises(UnkeyedRandomnessError, match="arithmetic on the batch size"):
        model(X)  # a draw on such a tensor: which sample each row is, is unknown


def test_fft_and_norms_keep_the_batch():
    def fnet(x):
        mixed = torch.fft.fft(torch.fft.fft(x.to(torch.complex64), dim=-1), dim=-2).real
        flat = F.layer_norm(mixed.reshape(-1, x.shape[-1]), (x.shape[-1],))  # (B*L, D) rows: OPT
        return F.dropout(flat, 0.5).reshape(x.shape)

    whole, halves = _masks(fnet, X)
    assert torch.equal(whole, halves)


def test_log_sigmoid_keeps_the_batch():
    """``F.logsigmoid`` (``aten.log_sigmoid_forward``: an output and a buffer; a gated attention's gate) keeps
    its input's batch (it had no rule: a later draw was refused)."""
    def gated(x):
        return F.dropout(x * F.logsigmoid(x.reshape(-1, x.shape[-1])).reshape(x.shape).exp(), 0.5)

    whole, halves = _masks(gated, X)
    assert torch.equal(whole, halves)


def test_a_triangular_solve_over_batched_matrices_keeps_the_batch_and_refuses_across_it():
    """``torch.linalg.solve_triangular`` (a delta-rule linear attention's chunk system): a batch in the leading
    dimensions is the result's; solving across the batch dimension (rows of several samples) is refused."""
    tri = torch.eye(6) + torch.tril(torch.full((6, 6), 0.1), -1)

    def solve(x):  # (B, L, D): each sample's (L, L) system
        system = tri + 0.01 * torch.tril(x @ x.transpose(1, 2), -1)
        return F.dropout(torch.linalg.solve_triangular(system, x, upper=False, unitriangular=True), 0.5)

    whole, halves = _masks(solve, X)
    assert torch.equal(whole, halves)
    model = Fn(lambda x: F.dropout(torch.linalg.solve_triangular(torch.eye(4), x[:, 0], upper=False), 0.5))
    with pytest.raises(UnkeyedRandomnessError, match="solves along the batch dimension 0 of its right-hand side"):
        with knn.keyed(model, 3, step=1):
            model(X)


def test_sequence_first_heads_and_einsum_attention_in_forwards_of_one_row():
    """A forward of one row: a reshape of a size-1 batch cannot tell which dimension it merged into, and
    einsum folds a size-1 batch dimension into the ones it contracts; every element is still that sample's."""

    def fsmt(x):  # sequence-first (L, B, D) -> (L, B*H, d) -> (B*H, L, d), as FSMT's attention
        length, b = x.shape[1], x.shape[0]
        q = x.transpose(0, 1).reshape(length, b * 2, 4).transpose(0, 1)
        probs = torch.bmm(q, q.transpose(1, 2)).softmax(-1)
        return F.dropout(probs, 0.5).reshape(b, 2, length, length)

    whole, halves = _masks(fsmt, X)
    assert torch.equal(whole, halves)

    def xlnet(x):  # (L, B, H, d) and einsum over them, as XLNet's relative attention
        q = x.transpose(0, 1).reshape(x.shape[1], x.shape[0], 2, 4)
        return F.dropout(torch.einsum("ibnd,jbnd->bnij", q, q).softmax(-1), 0.5)

    whole, halves = _masks(xlnet, X)
    assert torch.equal(whole, halves)


def test_a_forward_of_one_row_refuses_a_draw_sized_by_a_plain_one():
    """There x.shape[0] may be a plain 1 (its record in another dimension): a draw sized (1, ...) is not taken
    as replicated."""
    noise = Fn(lambda x: x + torch.rand(1, x.shape[1], 1))
    with knn.keyed(noise, 0, step=0):
        noise(X[:2])  # two rows: a (1, L, 1) draw broadcast over them is replicated
    with knn.keyed(noise, 0, step=0, sample_offset=2), \
            pytest.raises(UnkeyedRandomnessError, match=r"rand is sized \[1, 6, 1\]"):
        noise(X[2:3])
