"""A mixture of experts under FSDP2 on real gloo ranks: each rank's routed dropout masks are the single
process's at its rows, bit for bit, and the gradients are the single process's (keyinit.nn._batch.routed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import keyinit
import keyinit.nn as knn
from tests._support.dist import requires_gloo, run_distributed
from tests.nn.batch.test_keyed_routed import B, D, L, Top1

pytestmark = requires_gloo


def _inputs() -> torch.Tensor:
    return torch.randn(B, L, D, generator=torch.Generator().manual_seed(3))


def _model() -> Top1:
    model = Top1(experts=3)
    keyinit.init_model(model, 0)
    return model.train()


def _tapped(model: Top1, wrapped, h: torch.Tensor, offset: int) -> tuple[dict, dict, torch.Tensor]:
    """Under keyed (step 7, ``sample_offset=offset``): each expert's dropout ``(input, output)`` and rows (flat
    ``b * L + l``, global), and the output; then backward of its sum of squares."""
    seen: dict = {}
    handles = [e.drop.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, (a[0].detach(), o.detach())))
               for i, e in enumerate(model.experts)]
    try:
        with knn.keyed(wrapped, 0, step=7, sample_offset=offset):
            out = wrapped(h)
            out.square().sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    rows = {i: (idx + offset * L) for i, idx in model.picked.items()}
    return seen, rows, out.detach()


def _fsdp2_rank():
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    fully_shard(model)  # one all-gather for the root: the experts a rank runs depend on its rows
    per = B // world
    seen, rows, out = _tapped(model, model, _inputs()[rank * per:(rank + 1) * per], rank * per)
    grads = {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return seen, rows, out, grads


@pytest.mark.slow
def test_fsdp2_moe_routed_masks_and_gradients_equal_one_process():
    world = 2
    per_rank = run_distributed(_fsdp2_rank, world, timeout=240)
    reference = _model()
    seen, rows, out = _tapped(reference, reference, _inputs(), 0)
    per = B // world
    for rank, (r_seen, r_rows, r_out, _) in enumerate(per_rank):
        torch.testing.assert_close(r_out, out[rank * per:(rank + 1) * per], rtol=1e-5, atol=1e-6)
        for i, (x, y) in seen.items():
            mine = (rows[i] >= rank * per * L) & (rows[i] < (rank + 1) * per * L)
            if not bool(mine.any()):
                assert i not in r_seen
                continue
            assert torch.equal(r_rows[i], rows[i][mine])
            r_x, r_y = r_seen[i]
            live = (r_x != 0) & (x[mine] != 0)
            assert torch.equal((r_y != 0) & live, (y[mine] != 0) & live), (rank, i)  # the masks, bitwise
            torch.testing.assert_close(r_y, y[mine], rtol=1e-5, atol=1e-6)
    # each rank's loss is the sum over its rows: FSDP2 averages the ranks' gradients
    want = {n: p.grad / world for n, p in reference.named_parameters() if p.grad is not None}
    for _, _, _, grads in per_rank:
        assert grads.keys() == want.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-5, msg=name)
