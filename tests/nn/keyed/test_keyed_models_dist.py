"""Keyed dropout on real gloo ranks: the gathered result equals one process, with 0 collectives.

- The functional contract on DTensors (Shard(0), Shard(1), Shard(2), Replicate,
  uneven shapes, every dtype, forward and backward) on 2 ranks: the collectives
  issued during each dropout call are counted two ways (``CommDebugMode`` and
  wrappers around the c10d entry points, tests/init/test_model_dist.py's
  ``count_collectives``); full tensors are gathered afterwards and compared with
  one process, bit for bit.
- DropLlama (tests/nn/keyed/test_keyed_models.py) under ``keyed``: real data parallelism
  (DDP and FSDP2 over 2 ranks, each with its ``sample_offset``) gives the one-process
  logits and dropout outputs; tensor parallelism with sequence-parallel DTensor
  activations gives the one-process masks (the values differ only by the order
  of the row-parallel sums).
- A Transformer encoder (nn.MultiheadAttention, keyed attention dropout) with a
  2-rank DDP batch split: the attention masks equal one process bit for bit, the
  outputs to a tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import keyinit
import keyinit.nn as knn
from keyinit.nn import dropout_key
from keyinit.nn import functional as KF
from tests._support.dist import requires_gloo, run_distributed
from tests.nn.keyed.test_keyed_models import SEED, DropLlama, build, masks, tapped, tokens
from tests.init.test_model_dist import count_collectives

pytestmark = requires_gloo

KEY = dropout_key(11, step=4, fqn="layers.0.feed_forward", ordinal=1)
SHAPE = (5, 7, 9)  # uneven over 2 ranks in every dimension
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
CASES = [(dtype, 0.3) for dtype in DTYPES] + [(torch.float32, 0.05), (torch.float32, 0.9)]


def _placements():
    from torch.distributed.tensor import Replicate, Shard

    return {"Shard(0)": Shard(0), "Shard(1)": Shard(1), "Shard(2)": Shard(2), "Replicate": Replicate()}


def _inputs(dtype):
    g = torch.Generator().manual_seed(4)
    return torch.randn(SHAPE, generator=g, dtype=torch.float64).to(dtype), \
        torch.randn(SHAPE, generator=g, dtype=torch.float64).to(dtype)


def _functional_on_dtensors():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for name, placement in _placements().items():
        for dtype, p in CASES:
            x, grad = _inputs(dtype)
            dx = distribute_tensor(x, mesh, [placement], src_data_rank=None).requires_grad_()
            dgrad = distribute_tensor(grad, mesh, [placement], src_data_rank=None)
            with count_collectives() as counts:
                out = KF.dropout(dx, p, rng_key=KEY)
                out.backward(dgrad)
            results[(name, str(dtype), p)] = (
                out.full_tensor().detach(), dx.grad.full_tensor(), dict(counts), tuple(out.placements),
            )
    try:
        KF.dropout(dx, 0.5, rng_key=KEY, global_shape=SHAPE)
        results["global_shape"] = "no error"
    except TypeError as exc:
        results["global_shape"] = str(exc)
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()], run_check=False)
    try:
        KF.dropout(partial, 0.5, rng_key=KEY)
        results["partial"] = "no error"
    except ValueError as exc:
        results["partial"] = str(exc)
    return results


def _keyed_dtensor_rows():
    """keyed() on a model whose activation is a Shard(0) DTensor (each rank holds rows of the batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Dropout(0.5)
    x = torch.ones(6, 10)
    with knn.keyed(model, 1, step=2, sample_offset=4, stream="v1"):  # (the expected masks: v1 names)
        with count_collectives() as counts:
            out = model(distribute_tensor(x, mesh, [Shard(0)], src_data_rank=None))
    return out.full_tensor(), dict(counts)


@pytest.mark.slow
def test_functional_contract_on_dtensor_placements_2_ranks():
    per_rank = run_distributed(_functional_on_dtensors, 2, timeout=240)
    for name in _placements():
        for dtype, p in CASES:
            x, grad = _inputs(dtype)
            want = KF.dropout(x, p, rng_key=KEY)
            want_grad = KF.dropout(grad, p, rng_key=KEY)
            for rank, results in enumerate(per_rank):
                out, x_grad, counts, placements = results[(name, str(dtype), p)]
                assert counts == {"c10d": 0, "comm_debug": 0}, (name, dtype, rank, counts)
                assert placements == (_placements()[name],)
                assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (name, dtype, rank)
                assert torch.equal(x_grad.view(torch.uint8), want_grad.view(torch.uint8)), (name, dtype, rank)
    assert all("Partial" in r["partial"] for r in per_rank), per_rank[0]["partial"]
    assert all("come from its placements" in r["global_shape"] for r in per_rank), per_rank[0]["global_shape"]


# ----------------------------------------------------------------------------- models


def _data_parallel():
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    model = build()
    ddp = _data_parallel_run(model, DistributedDataParallel(model))
    sharded = DropLlama()
    for block in sharded.layers.values():
        fully_shard(block)
    fully_shard(sharded)
    keyinit.init_model(sharded, 0)  # the same weights as build()
    return {"ddp": ddp, "fsdp2": _data_parallel_run(sharded.train(), sharded)}


def _data_parallel_run(model, wrapped):
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = tokens()
    rows = ids.shape[0] // world
    lo = rank * rows
    taps: list = []
    handles = [m.register_forward_hook(lambda mod, args, out: taps.append(out))
               for m in model.modules() if isinstance(m, (torch.nn.Dropout, knn.Dropout))]
    for m in model.modules():
        if hasattr(m, "taps"):
            m.taps = taps
    with knn.keyed(wrapped, SEED, step=3, sample_offset=lo):  # DDP's "module." is stripped from the FQNs
        logits = wrapped(ids[lo:lo + rows])
        logits.sum().backward()
    for h in handles:
        h.remove()
    grads = {}
    for name, param in model.named_parameters():  # FSDP2's are shards of DTensors: gathered (every rank)
        grad = param.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return logits.detach(), [t.detach() for t in taps], lo, rows, grads


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_ddp_and_fsdp2_equal_one_process(world):
    per_rank = run_distributed(_data_parallel, world, timeout=240)
    reference = build()
    logits, taps = tapped(reference, tokens(), step=3)
    with knn.keyed(reference, SEED, step=3):  # the same keyed forward again, for the gradients
        reference(tokens()).sum().backward()
    # each rank's loss is the sum over its rows, and DDP and FSDP2 average the ranks' gradients
    want = {name: param.grad / world for name, param in reference.named_parameters()}
    for results in per_rank:
        for name in ("ddp", "fsdp2"):
            out, rank_taps, lo, rows, grads = results[name]
            assert grads.keys() == want.keys(), name
            for fqn, grad in grads.items():
                torch.testing.assert_close(grad, want[fqn], rtol=1e-4, atol=1e-5, msg=f"{name} {fqn}")
            # 4 rows per rank vs 8: torch's matmuls are not batch-invariant bitwise (CPU ISAs differ)
            torch.testing.assert_close(out, logits[lo:lo + rows], rtol=1e-5, atol=1e-5, msg=name)
            assert len(rank_taps) == len(taps)
            assert torch.equal(rank_taps[0], taps[0][lo:lo + rows]), name  # keyed values of the exact embedding
            for got, whole in zip(rank_taps, taps):
                assert torch.equal(got != 0, whole[lo:lo + rows] != 0), name  # the masks, bitwise
                torch.testing.assert_close(got, whole[lo:lo + rows], rtol=1e-5, atol=1e-6, msg=name)


def tp_sp_plan(model: DropLlama) -> dict:
    """Tensor + sequence parallelism with DTensor activations everywhere (use_local_output=False)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False),
    }
    for name in model.layers:
        prefix = f"layers.{name}"
        for sub in ("attention", "feed_forward"):
            plan[f"{prefix}.{sub}"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=False
            )
        for norm in ("attention_norm", "ffn_norm"):
            plan[f"{prefix}.{norm}"] = SequenceParallel()
        for leaf in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"{prefix}.{leaf}"] = ColwiseParallel(use_local_output=False)
        for leaf in ("attention.wo", "feed_forward.w2"):
            plan[f"{prefix}.{leaf}"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


def _tensor_sequence_parallel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = DropLlama()
    parallelize_module(model, mesh, tp_sp_plan(model))
    keyinit.init_model(model, 0)  # the same weights as one process
    model.train()
    logits, taps = tapped(model, tokens(), step=5, sample_offset=2)
    placements = [str(t.placements) for t in taps if isinstance(t, DTensor)]
    full = [(t.full_tensor() if isinstance(t, DTensor) else t).detach() for t in taps]
    rows = _keyed_dtensor_rows()
    return logits.full_tensor().detach(), full, placements, rows


@pytest.mark.slow
def test_tensor_and_sequence_parallel_masks_equal_one_process():
    per_rank = run_distributed(_tensor_sequence_parallel, 2, timeout=240)
    logits, taps = tapped(build(), tokens(), step=5, sample_offset=2)
    for out, rank_taps, placements, (rows, counts) in per_rank:
        assert len(placements) == len(taps), "every dropout input was a DTensor"
        assert any("Shard(dim=1)" in p for p in placements) and any("Shard(dim=2)" in p for p in placements)
        for got, whole in zip(masks(rank_taps), masks(taps)):
            assert torch.equal(got, whole)
        assert torch.allclose(out, logits, atol=1e-5)  # row-parallel sums reassociate: not bitwise
        assert counts == {"c10d": 0, "comm_debug": 0}
        assert torch.equal(rows, KF.dropout(torch.ones(6, 10), 0.5, rng_key=dropout_key(1, step=2, fqn="", ordinal=0), global_shape=(10, 10),
                                            region=(slice(4, 10), slice(None))))


# ----------------------------------------------------------------------------- attention dropout, 2 ranks


def _attention_model():
    torch.manual_seed(0)  # only for the module constructors; keyinit.init_model sets every weight
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.2, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    keyinit.init_model(model, 0)
    return model.train()


def _attention_inputs():
    return torch.randn(6, 5, 16, generator=torch.Generator().manual_seed(3))


def _attention_run(model, x, sample_offset, wrapped=None):
    weights = []
    attn = model.layers[0].self_attn
    call = attn.forward

    def forward(*args, **kwargs):  # ask layer 0's attention for its (dropped) per-head weights
        kwargs.update(need_weights=True, average_attn_weights=False)
        out, w = call(*args, **kwargs)
        weights.append(w.detach())
        return out, w

    attn.forward = forward
    try:
        wrapped = model if wrapped is None else wrapped
        with knn.keyed(wrapped, SEED, step=1, sample_offset=sample_offset):  # DDP's "module." is stripped
            out = wrapped(x)
        out.sum().backward()
    finally:
        del attn.forward
    return out.detach(), weights[0]


def _attention_data_parallel():
    from torch.nn.parallel import DistributedDataParallel

    model = _attention_model()
    ddp = DistributedDataParallel(model)
    rows = 6 // dist.get_world_size()
    lo = dist.get_rank() * rows
    out, weights = _attention_run(model, _attention_inputs()[lo:lo + rows], lo, wrapped=ddp)
    return out, weights, lo, rows


@pytest.mark.slow
def test_attention_dropout_2_rank_batch_split_equals_one_process():
    out, weights = _attention_run(_attention_model(), _attention_inputs(), 0)
    for rank_out, rank_weights, lo, rows in run_distributed(_attention_data_parallel, 2, timeout=120):
        assert torch.equal(rank_weights != 0, weights[lo:lo + rows] != 0)  # the masks, bitwise
        torch.testing.assert_close(rank_out, out[lo:lo + rows], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the sample_offset rule


def _sample_offset_rule():
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    errors = []
    try:
        knn.keyed(model, 0, step=0)
    except ValueError as exc:
        errors.append(str(exc))
    ddp = DistributedDataParallel(model)
    try:
        knn.keyed(ddp, 0, step=0, sample_offset=0)
        errors.append("accepted")
    except ValueError as exc:
        errors.append(str(exc))
    knn.keyed(model, 0, step=0, sample_offset=0)  # explicit 0: tensor parallelism, every rank the whole batch
    knn.keyed(ddp, 0, step=0, sample_offset=4 * dist.get_rank())
    return errors


@pytest.mark.slow
def test_sample_offset_is_required_under_more_than_one_rank():
    rank0, rank1 = run_distributed(_sample_offset_rule, 2, timeout=120)
    for errors in (rank0, rank1):
        assert "initialized with 2 ranks, so sample_offset must be given" in errors[0]
    assert rank0[1] == "accepted"  # rank 0's first sample is global sample 0
    assert "sample_offset=0 on rank 1 of the DistributedDataParallel group" in rank1[1]


# ----------------------------------------------------------------------------- attention on DTensors


class _Sdpa(torch.nn.Module):
    def __init__(self, is_causal: bool = False) -> None:
        super().__init__()
        self.is_causal = is_causal

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.4, is_causal=self.is_causal)


def _attention_qkv():
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 4, 6, 8, generator=g)
    v = torch.eye(6).expand(2, 4, 6, 6).contiguous()  # the output IS the dropped probability matrix
    return q, k, v


def _attention_dtensors():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = _attention_qkv()
    out = {}
    for name, (pq, pkv) in {"heads": (Shard(1), Shard(1)), "queries": (Shard(2), Replicate())}.items():
        dq = distribute_tensor(q, mesh, [pq])
        dk, dv = (distribute_tensor(t, mesh, [pkv]) for t in (k, v))
        for causal in (False, True):
            with knn.keyed(model := _Sdpa(causal), SEED, step=2, sample_offset=0):
                result = model(dq, dk, dv)
            out[name, causal] = (str(result.placements), result.full_tensor())
    return out


@pytest.mark.slow
def test_attention_dropout_on_head_and_query_sharded_dtensors_equals_one_process():
    wholes = {}
    for causal in (False, True):
        with knn.keyed(model := _Sdpa(causal), SEED, step=2):
            wholes[causal] = model(*_attention_qkv())
    for per_rank in run_distributed(_attention_dtensors, 2, timeout=120):
        for (name, causal), (placements, full) in per_rank.items():
            whole = wholes[causal]
            assert "Shard" in placements, name
            # the masks, bitwise (causal: the masked-out probabilities are 0 in both)
            assert torch.equal(full != 0, whole != 0), (name, causal)
            torch.testing.assert_close(full, whole, rtol=1e-5, atol=1e-6, msg=name)
