"""Rows of the batch picked by values (keyinit.nn._batch.routed): mixture-of-experts dispatch under keyed().

The promise, tested as a promise: element-wise dropout of rows a router picked (``x[idx]``, ``x[mask]``,
``index_select``) is keyed as the same dropout of the *virtual* tensor (the rows in their place in the batch,
``dropout_rows`` of a ``(B, L, F)`` tensor), bit for bit, so the masks depend neither on the batch split nor
on which expert a row went to; rows written back (``index_add``, ``index_copy``, ``y[inv_perm]``) are a batch
again, checked on the values; what cannot be keyed is refused with the reason.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError
from keyinit.nn import dropout_key
from keyinit.nn.functional import dropout_rows

P = 0.3
B, L, D = 4, 5, 8


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Dropout(P)

    def forward(self, x):
        return self.down(self.drop(F.gelu(self.up(x))))


class Top1(nn.Module):
    """Switch/Mixtral-style top-1 dispatch: ``torch.where`` rows per expert, ``x[idx]``, ``index_add_`` back.
    ``dispatch``: ``index`` (``x[idx]``), ``select`` (``index_select``), ``mask`` (``h[mask]`` on the
    unflattened ``(B, L, D)`` activation, written back with ``out[mask] = y``), ``put`` (``x[idx]`` written
    into ``torch.zeros(B * L, D)`` with ``out[idx] = y``), ``gather`` (``x.gather(0, idx.expand)``,
    ``scatter_add_`` back into ``x.new_zeros(x.shape)``) or ``sort`` (grouped-matmul style: the rows in the
    order ``torch.sort`` puts their experts, scaled by the sorted expert ids, each expert on its segment,
    ``index_add_`` back by the sort's indices)."""

    def __init__(self, experts: int = 3, dispatch: str = "index") -> None:
        super().__init__()
        self.router = nn.Linear(D, experts)
        self.experts = nn.ModuleList(Expert(D) for _ in range(experts))
        self.drop = nn.Dropout(P)
        self.dispatch = dispatch
        self.picked: dict[int, torch.Tensor] = {}  # expert -> the flat (b * L + l) rows it got, last forward

    def forward(self, h):
        b, l, d = h.shape
        x = h.reshape(-1, d)
        choice = self.router(x).argmax(-1)
        if self.dispatch == "mask":
            out = torch.zeros_like(h)
        elif self.dispatch == "put":
            out = torch.zeros(b * l, d)  # constant, sized by arithmetic on the batch size
        elif self.dispatch == "gather":
            out = x.new_zeros(x.shape)
        else:
            out = torch.zeros_like(x)
        self.picked = {}
        if self.dispatch == "sort":
            # along the batch-holding rows: both outputs are rows picked by the sort's indices
            sorted_choice, order = torch.sort(choice, stable=True)
            rows = x[order] * (sorted_choice[:, None] + 1).to(x.dtype)  # (the sorted values used as they are)
            ends = torch.bincount(choice, minlength=len(self.experts)).cumsum(0).tolist()
            ys, start = [], 0
            for i, (expert, end) in enumerate(zip(self.experts, ends)):
                if end > start:
                    self.picked[i] = order[start:end]
                    ys.append(expert(rows[start:end]))
                start = end
            out.index_add_(0, order, torch.cat(ys))
            return self.drop(out.view(b, l, d)) + h
        for i, expert in enumerate(self.experts):
            if self.dispatch == "mask":
                mask = (choice == i).view(b, l)
                if not bool(mask.any()):
                    continue
                self.picked[i] = mask.reshape(-1).nonzero().reshape(-1)
                out[mask] = expert(h[mask])
                continue
            idx = torch.where(choice == i)[0]
            if idx.numel() == 0:
                continue
            self.picked[i] = idx
            if self.dispatch == "gather":
                at = idx[:, None].expand(-1, d)
                out.scatter_add_(0, at, expert(x.gather(0, at)))
            elif self.dispatch == "put":
                out[idx] = expert(x[idx])
            else:
                rows = x[idx] if self.dispatch == "index" else x.index_select(0, idx)
                out.index_add_(0, idx, expert(rows))
        return self.drop(out.view(b, l, d)) + h


def _tap(model: nn.Module) -> tuple[dict, list]:
    """Forward hooks on every expert's dropout: ``{expert: (input, output)}`` of the last forward."""
    seen: dict = {}
    handles = [e.drop.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, (a[0].detach(), o.detach())))
               for i, e in enumerate(model.experts)]
    return seen, handles


def _virtual(step: int, expert: int, x: torch.Tensor, rows: torch.Tensor, first_sample: int, count: int):
    """The keyed dropout of the virtual ``(count, L, F)`` tensor holding ``x``'s rows at ``rows`` (flat
    ``b * L + l``, local), at those rows: what keyed() must give the routed rows."""
    virtual = torch.zeros(count * L, x.shape[1])
    virtual[rows] = x
    k = dropout_key(0, step=step, fqn=f"experts.{expert}.drop", ordinal=0)
    return dropout_rows(virtual.view(count, L, -1), P, k, first_sample).view(count * L, -1)[rows]


@pytest.mark.parametrize("dispatch", ["index", "select", "mask", "put", "gather", "sort"])
def test_routed_dropout_is_the_virtual_tensors_dropout_and_split_invariant(dispatch):
    torch.manual_seed(0)
    model = Top1(dispatch=dispatch).train()
    h = torch.randn(B, L, D)
    seen, handles = _tap(model)
    try:
        for step in (0, 1):  # a new step: new masks, the same routing (the replay cache keeps no rows)
            with knn.keyed(model, 0, step=step, stream="v1"):
                whole = model(h)
            assert len(seen) >= 2, "the test needs rows routed to at least two experts"
            for i, (x, y) in seen.items():
                assert torch.equal(y, _virtual(step, i, x, model.picked[i], 0, B)), (dispatch, step, i)
            whole_seen, parts, part_seen = dict(seen), [], []
            for lo, hi in ((0, 1), (1, 3), (3, 4)):
                seen.clear()
                with knn.keyed(model, 0, step=step, sample_offset=lo, stream="v1"):
                    parts.append(model(h[lo:hi]))
                for i, (x, y) in seen.items():
                    assert torch.equal(y, _virtual(step, i, x, model.picked[i], lo, hi - lo)), (dispatch, lo, i)
                part_seen.append(dict(seen))
            torch.testing.assert_close(torch.cat(parts), whole)
            for i, (_, y) in whole_seen.items():  # the split's rows of an expert, in order, are the whole's
                torch.testing.assert_close(torch.cat([p[i][1] for p in part_seen if i in p]), y)
            seen.clear()
    finally:
        for handle in handles:
            handle.remove()


def test_routed_rows_differ_per_step_and_route():
    """Two experts' dropouts of the same row draw different masks (their FQNs), a step draws new ones."""
    torch.manual_seed(1)
    model = Top1().train()
    h = torch.randn(B, L, D)
    seen, handles = _tap(model)
    try:
        outs = []
        for step in (0, 1):
            with knn.keyed(model, 0, step=step):
                outs.append(model(h))
        assert not torch.equal(outs[0], outs[1])
    finally:
        for handle in handles:
            handle.remove()


class TopK(nn.Module):
    """Nemotron-H/grouped-GEMM-style top-k dispatch: tokens sorted by expert (``x[perm // k]``), weighted,
    unsorted by ``inv_perm`` and summed over their k copies; then a dropout of the (B, L, D) output."""

    def __init__(self, k: int = 2, experts: int = 4, drop_copies: bool = False) -> None:
        super().__init__()
        self.k, self.router = k, nn.Linear(D, experts)
        self.w = nn.Parameter(torch.randn(experts, D, D) * 0.1)
        self.drop = nn.Dropout(P)
        self.copies = nn.Dropout(P) if drop_copies else None

    def forward(self, h):
        b, l, d = h.shape
        x = h.reshape(-1, d)
        weights, experts = self.router(x).softmax(-1).topk(self.k, dim=-1)
        _, perm = torch.sort(experts.reshape(-1))
        rows = x[perm // self.k]
        if self.copies is not None:
            rows = self.copies(rows)
        # each row's expert matrix by its own token's choice (the sorted ids would be a sort's values: unknown)
        chosen = self.w[experts.reshape(-1)[perm]]
        y = torch.bmm(rows.unsqueeze(1), chosen).squeeze(1) * weights.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        out = y[inv].view(b * l, self.k, d).sum(1)
        return self.drop(out.view(b, l, d)) + h


def test_sorted_topk_dispatch_is_a_batch_again_after_unsorting():
    torch.manual_seed(0)
    model = TopK().train()
    h = torch.randn(B, L, D)
    with knn.keyed(model, 0, step=3, stream="v1"):
        whole = model(h)
    parts = []
    for lo, hi in ((0, 2), (2, 4)):
        with knn.keyed(model, 0, step=3, sample_offset=lo, stream="v1"):
            parts.append(model(h[lo:hi]))
    torch.testing.assert_close(torch.cat(parts), whole)
    # the output dropout's mask is dropout_rows' own (the batch came back in dimension 0)
    with torch.no_grad(), knn.keyed(model, 0, step=3, stream="v1"):
        model.drop.register_forward_hook(lambda m, a, o: setattr(m, "seen", (a[0], o)))
        model(h)
    x, y = model.drop.seen
    assert torch.equal(y, dropout_rows(x, P, dropout_key(0, step=3, fqn="drop", ordinal=0), 0))


def test_sorted_topk_dispatch_of_one_row_is_that_rows_part_of_the_batch():
    """A forward of one sample (the usual LLM micro-batch): its top-k copies are one sample's rows (a batch of
    count 1) and its routing weights picked by the sort stay routed; their product is still that sample's, so
    the output dropout is keyed (was refused: 'combines tensors whose batches are laid out differently') with
    the sample's masks in the whole batch, bitwise, and a second such layer keys on what the first gave back."""
    torch.manual_seed(0)
    model = nn.Sequential(TopK(), TopK()).train()
    h = torch.randn(B, L, D)
    seen: list = []
    hooks = [layer.drop.register_forward_hook(lambda m, a, o: seen.append((a[0] != 0) & (o == 0))) for layer in model]
    try:
        with torch.no_grad(), knn.keyed(model, 0, step=3, stream="v2"):
            whole = model(h)
        whole_masks, seen[:] = list(seen), []
        for r in range(B):
            with torch.no_grad(), knn.keyed(model, 0, step=3, sample_offset=r, stream="v2"):
                row = model(h[r:r + 1])
            torch.testing.assert_close(row, whole[r:r + 1], rtol=1e-5, atol=1e-5)
            assert [m.shape[0] for m in seen] == [1, 1]
            for got, want in zip(seen, whole_masks):
                assert torch.equal(got[0], want[r]), r
            seen[:] = []
    finally:
        for hook in hooks:
            hook.remove()


def test_dropout_of_a_token_picked_k_times_is_refused():
    model = TopK(drop_copies=True).train()
    with pytest.raises(UnkeyedRandomnessError, match="picked more than once"):
        with knn.keyed(model, 0, step=0):
            model(torch.randn(B, L, D))


class Misrouted(nn.Module):
    """Each token's row written back to the position of the token L rows on (another sample's), then dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(D, D), nn.Dropout(P)

    def forward(self, h):
        x = h.reshape(-1, D)
        n = x.shape[0]
        perm = torch.arange(n).roll(L)
        out = torch.zeros(n, D).index_add(0, torch.arange(n), self.lin(x[perm]))
        return self.drop(out)


def test_rows_written_to_other_samples_positions_are_refused():
    model = Misrouted().train()
    with pytest.raises(UnkeyedRandomnessError, match="written by index to positions of other samples"):
        with knn.keyed(model, 0, step=0):
            model(torch.randn(B, L, D))


class Drawn(nn.Module):
    """A random op other than dropout on rows a router picked (``pick``), or on the batch before the pick
    (the same op's values, picked after): keyed alike, element by element (``kind``: ``rand_like``,
    ``uniform_`` in place, ``bernoulli`` of probabilities of the rows' shape)."""

    def __init__(self, kind: str, pick: bool, rows: list) -> None:
        super().__init__()
        self.kind, self.pick, self.rows = kind, pick, rows

    def draw(self, x):
        if self.kind == "rand_like":
            return torch.rand_like(x)
        if self.kind == "uniform_":
            return x.clone().uniform_(-1.0, 1.0)
        return torch.bernoulli(x.sigmoid())

    def forward(self, h):
        x = h.reshape(-1, D)
        idx = torch.tensor(self.rows)
        return self.draw(x[idx]) if self.pick else self.draw(x)[idx]


@pytest.mark.parametrize("kind", ["rand_like", "uniform_", "bernoulli"])
def test_other_draws_on_routed_rows_are_the_virtual_tensors_values(kind):
    h = torch.randn(B, L, D)
    rows = [3, 0, 17, 9, 12]
    outs = []
    for pick in (True, False):
        model = Drawn(kind, pick, rows)
        with knn.keyed(model, 0, step=4):
            outs.append(model(h))
    assert torch.equal(outs[0], outs[1])
    # the rows of samples 2..3 alone (sample_offset=2): the same values
    model = Drawn(kind, True, [r - 2 * L for r in rows if r >= 2 * L])
    with knn.keyed(model, 0, step=4, sample_offset=2):
        part = model(h[2:])
    assert torch.equal(part, outs[0][[i for i, r in enumerate(rows) if r >= 2 * L]])


def test_draws_on_a_row_picked_twice_are_refused():
    model = Drawn("rand_like", True, [3, 3, 7])
    with pytest.raises(UnkeyedRandomnessError, match="picked more than once"):
        with knn.keyed(model, 0, step=0):
            model(torch.randn(B, L, D))


class Checkpointed(nn.Module):
    """The top-1 MoE layer under activation checkpointing: the recompute routes again and draws again."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.moe, self.reentrant = Top1(), reentrant

    def forward(self, h):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.moe, h, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("backward_inside", [False, True])
def test_checkpointed_moe_recomputes_the_same_routed_masks(reentrant, backward_inside):
    torch.manual_seed(0)
    model = Checkpointed(reentrant).train()
    h = torch.randn(B, L, D, requires_grad=True)
    grads = []
    for checkpointed in (False, True):
        model.zero_grad()
        h.grad = None
        fn = model if checkpointed else model.moe
        with knn.keyed(model, 0, step=5):
            out = fn(h) if checkpointed else model.moe(h)
            if backward_inside:
                out.square().sum().backward()
        if not backward_inside:
            out.square().sum().backward()
        grads.append([h.grad.clone()] + [p.grad.clone() for p in model.moe.experts.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_compiled_moe_equals_the_eager_keyed_forward():
    """Under keyinit.nn.compile, rows routed in one part of the forward and dropped in a graph after it: no
    routing seen while tracing is reused (keyinit.nn._batch.propagate.propagate_traced), each call's values are the
    eager keyed forward's, for new steps, offsets and routings."""
    import warnings

    torch.manual_seed(0)
    model = Top1().train()
    compiled = knn.compile(model, backend="aot_eager")
    h = torch.randn(B, L, D)
    for step, offset, rows in [(0, 0, h), (1, 2, h[2:]), (2, 0, h.flip(0) * 3)]:
        with knn.keyed(model, 0, step=step, sample_offset=offset):
            eager = model(rows)
        with knn.keyed(compiled, 0, step=step, sample_offset=offset), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert torch.equal(compiled(rows), eager), (step, offset)
