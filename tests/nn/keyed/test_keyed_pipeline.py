"""keyed() under torch.distributed.pipelining: each micro-batch keyed with its rows (real gloo ranks).

A 2-stage pipeline (GPipe forward-only, 1F1B with a loss and backward), and 4 stages
interleaved on 2 ranks (Interleaved1F1B, two keyed contexts per rank), over a
model whose blocks drop elements (nn.Dropout) and whole samples (a DropPath-style
per-sample bernoulli_): the last stage's output and every parameter's gradient
equal the unpipelined single-process keyed run (torch's matmuls compared with a
tolerance), and the masks are those of the whole batch, not repeated per
micro-batch.
"""

from __future__ import annotations

import pytest
import torch

import keyinit
import keyinit.nn as knn
from keyinit.nn._context.pipeline import chunk_offsets
from tests._support.dist import requires_gloo, run_distributed
from tests._support.nets import BlockStack

SEED, STEP, BATCH, CHUNKS = 7, 3, 6, 2


def _net() -> BlockStack:
    net = BlockStack(dim=8, depth=4, p=0.3, keep=0.75)
    keyinit.init_model(net, 0)
    return net.train()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x = (torch.arange(BATCH * 3 * 8, dtype=torch.float32).reshape(BATCH, 3, 8) % 11) / 11 - 0.5
    return x, torch.zeros(BATCH, 3, 8)


def _reference(backward: bool) -> tuple[torch.Tensor, dict]:
    net, (x, target) = _net(), _inputs()
    with knn.keyed(net, SEED, step=STEP):
        out = net(x)
        if backward:
            torch.nn.functional.mse_loss(out, target, reduction="sum").backward()
    return out.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def _pipelined(schedule_name: str, backward: bool):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    net = _net()
    for name in list(net.layers.keys()):  # torchtitan's cut: the stage keeps the full model's FQNs
        if (int(name) < 2) != (rank == 0):
            del net.layers[name]
    stage = PipelineStage(net, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    loss = (lambda out, target: torch.nn.functional.mse_loss(out, target, reduction="sum")) if backward else None
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = cls(stage, n_microbatches=CHUNKS, loss_fn=loss, scale_grads=False)  # sums, as the reference
    x, target = _inputs()
    rng = torch.get_rng_state()
    with knn.keyed(net, SEED, step=STEP, sample_offset=0) as ctx, knn.micro_batches(stage, ctx, batch_size=BATCH, n_microbatches=CHUNKS):
        if rank == 0:
            schedule.step(x)
            out = None
        else:
            out = schedule.step(target=target) if backward else schedule.step()
    assert torch.equal(rng, torch.get_rng_state())
    grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    return (None if out is None else out.detach()), grads


@requires_gloo
@pytest.mark.parametrize("schedule_name,backward", [("gpipe", False), ("1f1b", True)])
def test_pipeline_micro_batches_draw_the_whole_batchs_masks(schedule_name, backward):
    reference, ref_grads = _reference(backward)
    per_rank = run_distributed(_pipelined, 2, args=(schedule_name, backward), timeout=180)
    out = per_rank[1][0]
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    if backward:
        grads = {**per_rank[0][1], **per_rank[1][1]}
        assert set(grads) == set(ref_grads)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def _interleaved():
    """Interleaved 1F1B: 4 stages of one layer on 2 ranks (rank r holds stages r and r + 2), each stage
    keyed by its own context and adapter, with a loss and backward."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    nets, stages = [], []
    for index in (rank, rank + world):
        net = _net()
        for name in list(net.layers.keys()):  # the stage keeps the full model's FQN of its layer
            if int(name) != index:
                del net.layers[name]
        nets.append(net)
        stages.append(PipelineStage(net, stage_index=index, num_stages=2 * world, device=torch.device("cpu")))
    loss = lambda out, target: torch.nn.functional.mse_loss(out, target, reduction="sum")  # noqa: E731
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=CHUNKS, loss_fn=loss, scale_grads=False)
    x, target = _inputs()
    rng = torch.get_rng_state()
    with contextlib.ExitStack() as stack:
        for net, stage in zip(nets, stages):
            ctx = stack.enter_context(knn.keyed(net, SEED, step=STEP, sample_offset=0))
            stack.enter_context(knn.micro_batches(stage, ctx, batch_size=BATCH, n_microbatches=CHUNKS))
        out = schedule.step(x) if rank == 0 else schedule.step(target=target)
    assert torch.equal(rng, torch.get_rng_state())
    grads = {n: p.grad.clone() for net in nets for n, p in net.named_parameters() if p.grad is not None}
    return (None if out is None else out.detach()), grads


@requires_gloo
def test_interleaved_1f1b_micro_batches_draw_the_whole_batchs_masks():
    reference, ref_grads = _reference(True)
    per_rank = run_distributed(_interleaved, 2, timeout=180)
    torch.testing.assert_close(per_rank[1][0], reference, rtol=1e-5, atol=1e-6)  # the last stage (3) is rank 1's
    grads = {**per_rank[0][1], **per_rank[1][1]}
    assert set(grads) == set(ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_without_the_adapter_both_micro_batches_would_repeat_rows_0_and_differ():
    """What the adapter fixes: two forwards of the chunks without micro_batch() both start at row 0."""
    net, (x, _) = _net(), _inputs()
    reference, _ = _reference(False)
    with knn.keyed(net, SEED, step=STEP) as ctx:
        with ctx.micro_batch(0):
            first = net(x[:3])
        with ctx.micro_batch(3):
            second = net(x[3:])
    torch.testing.assert_close(torch.cat([first, second]), reference, rtol=1e-5, atol=1e-6)
    with knn.keyed(net, SEED, step=STEP):
        wrong = torch.cat([net(x[:3]), net(x[3:])])
    assert not torch.allclose(wrong, reference)


def test_chunk_offsets_follow_tensor_split():
    for n in range(0, 9):
        for m in range(1, 5):
            sizes = [len(c) for c in torch.tensor_split(torch.arange(n), m)]
            assert chunk_offsets(n, m) == [sum(sizes[:i]) for i in range(m)]
